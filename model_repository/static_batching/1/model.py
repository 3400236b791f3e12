"""static_batching: a thin adapter; the batching policy lives in batchlm.backend.static_service."""


class TritonPythonModel:
    def initialize(self, args):
        # NOTE: here, not at the top: Triton also imports this file in a config-only stub, where torch costs seconds
        from batchlm.engine.batch_generator import BatchGenerator
        from batchlm.backend import triton_io
        from batchlm.backend.instance_claim import InstanceClaim
        from batchlm.backend.metrics import ModelMetrics
        from batchlm.backend.serving_config import check_batch_fits
        from batchlm.backend.static_service import StaticBatchingService

        name, config, model_dir = triton_io.load_serving_config(args, decoupled=False, static=True)
        check_batch_fits(config.engine, config.batch_size, "batch_size")
        self.claim = InstanceClaim(args["model_instance_name"])
        self.service = StaticBatchingService(lambda: BatchGenerator.from_dir(model_dir, config.engine),
                                             ModelMetrics(name, args["model_instance_name"]), config.batch_size,
                                             config.max_waiting, name, triton_io.readiness_probe(name),
                                             is_superseded=self.claim.superseded,
                                             cancel_check_period=config.cancellation_check_period_ms / 1000,
                                             max_wait=config.max_wait_ms / 1000,
                                             fault_injection=config.fault_injection)
        self.claim.claim()  # NOTE: last: a successor that fails to load must not supersede this instance

    def is_ready(self):
        # NOTE: Triton's Python backend asks this from release 26.03 on; 2.51 never does (see the serve
        # command's supervisor)
        return self.service.serving

    def execute(self, requests):
        for request in requests:
            self.service.submit(request)
        return None

    def finalize(self):
        self.service.close()
        self.claim.release()
