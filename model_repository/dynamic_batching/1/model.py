"""dynamic_batching: a thin adapter; Triton forms the batch, batchlm.backend.dynamic_service runs it."""


class TritonPythonModel:
    def initialize(self, args):
        # NOTE: here, not at the top: Triton also imports this file in a config-only stub, where torch costs seconds
        from batchlm.engine.batch_generator import BatchGenerator
        from batchlm.backend import triton_io
        from batchlm.backend.dynamic_service import DynamicBatchingService
        from batchlm.backend.metrics import ModelMetrics
        from batchlm.backend.serving_config import check_batch_fits

        name, config, model_dir = triton_io.load_serving_config(args, decoupled=False)
        check_batch_fits(config.engine, triton_io.model_config(args)["max_batch_size"], "max_batch_size")
        generator = BatchGenerator.from_dir(model_dir, config.engine)
        self.service = DynamicBatchingService(generator, ModelMetrics(name, args["model_instance_name"]), name,
                                              config.cancellation_check_period_ms / 1000, config.fault_injection)

    def is_ready(self):
        # NOTE: Triton's Python backend asks this from release 26.03 on; 2.51 never does (see the serve
        # command's supervisor)
        return self.service.serving

    def execute(self, requests):
        return self.service.execute(requests)

    def finalize(self):
        self.service.close()
