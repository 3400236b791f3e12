"""continuous_batching_trtllm: a thin adapter; the front lives in batchlm.backend.trtllm.service."""


class TritonPythonModel:
    def initialize(self, args):
        # NOTE: here, not at the top: Triton also imports this file in a config-only stub, where torch costs seconds
        from batchlm.model.tokenizer import Tokenizer
        from batchlm.backend import triton_io
        from batchlm.backend.metrics import ModelMetrics
        from batchlm.backend.trtllm import protocol as trtllm_protocol
        from batchlm.backend.trtllm.bls import TrtllmBls
        from batchlm.backend.trtllm.bls_reaper import BlsReaper
        from batchlm.backend.trtllm.front_config import TrtllmFrontConfig
        from batchlm.backend.trtllm.service import TrtllmFrontService

        config = triton_io.model_config(args)
        name = config["name"]
        triton_io.require_transaction_policy(config, decoupled=True)
        front = TrtllmFrontConfig.from_parameters(triton_io.parameters(config))
        tokenizer = Tokenizer.from_dir(triton_io.resolve_model_dir(front.model_dir))
        eos = trtllm_protocol.end_id(tokenizer.eos_token_ids)
        pad = eos if eos is not None else 0
        reaper = BlsReaper()
        self.service = TrtllmFrontService(name, front, tokenizer, TrtllmBls(front.backend_model, eos, pad, reaper),
                                          ModelMetrics(name, args["model_instance_name"]), reaper)

    def execute(self, requests):
        for request in requests:
            self.service.submit(request)
        return None

    def finalize(self):
        self.service.close()
