"""dynamic_batching: a thin adapter; Triton forms the batch, batchlm.serving.dynamic_service runs it."""

from batchlm.batch_generator import BatchGenerator
from batchlm.serving import triton_io
from batchlm.serving.dynamic_service import DynamicBatchingService
from batchlm.serving.metrics import ModelMetrics


class TritonPythonModel:
    def initialize(self, args):
        name, config, model_dir = triton_io.load_serving_config(args, decoupled=False)
        generator = BatchGenerator.from_dir(model_dir, config.engine)
        self.service = DynamicBatchingService(generator, ModelMetrics(name, args["model_instance_name"]), name,
                                              config.cancellation_check_period_ms / 1000)

    def execute(self, requests):
        return self.service.execute(requests)
