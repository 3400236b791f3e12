"""continuous_batching_trtllm: a thin adapter; the front lives in batchlm.serving.trtllm.service."""


class TritonPythonModel:
    def initialize(self, args):
        # NOTE: here, not at the top: Triton also imports this file in a config-only stub, where torch costs seconds
        from batchlm.model.tokenizer import Tokenizer
        from batchlm.serving import triton_io
        from batchlm.serving.metrics import ModelMetrics
        from batchlm.serving.trtllm import protocol as trtllm_protocol
        from batchlm.serving.trtllm.bls import TrtllmBls
        from batchlm.serving.trtllm.bls_reaper import BlsReaper
        from batchlm.serving.trtllm.front_config import TrtllmFrontConfig
        from batchlm.serving.trtllm.service import TrtllmFrontService

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
