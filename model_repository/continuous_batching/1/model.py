"""continuous_batching: a thin adapter; the engine thread lives in batchlm.backend.continuous_service."""


class TritonPythonModel:
    def initialize(self, args):
        # NOTE: here, not at the top: Triton also imports this file in a config-only stub, where torch costs seconds
        from batchlm.engine.engine import LLMEngine
        from batchlm.backend import triton_io
        from batchlm.backend.continuous_service import ContinuousBatchingService
        from batchlm.backend.metrics import ModelMetrics

        name, config, model_dir = triton_io.load_serving_config(args, decoupled=True)
        self.service = ContinuousBatchingService(lambda: LLMEngine(model_dir, config.engine),
                                                 ModelMetrics(name, args["model_instance_name"]), config.max_waiting,
                                                 config.cancellation_check_period_ms / 1000,
                                                 config.stream_interval, name, config.fault_injection)

    def execute(self, requests):
        for request in requests:
            self.service.submit(request)
        return None

    def is_ready(self):
        # NOTE: Triton's Python backend asks this from release 26.03 on; 2.51 never does (see the serve
        # command's supervisor)
        return self.service.serving

    def finalize(self):
        self.service.close()
