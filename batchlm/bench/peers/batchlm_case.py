"""The project's engine's case: continuous batching, built and stepped on one thread."""

from __future__ import annotations

import argparse
import threading
import time

from batchlm.bench.peers.groups import now_since
from batchlm.bench.peers.workload import PeerRequest

def run_batchlm(requests: list[PeerRequest], args: argparse.Namespace) -> dict:
    """The project's engine, built and stepped on one thread (as the services do)."""
    result: dict = {}

    def build():
        from batchlm.engine.engine import LLMEngine
        from batchlm.engine.engine_config import EngineConfig

        return LLMEngine(args.model_dir, EngineConfig(max_num_seqs=args.max_num_seqs, num_threads=args.threads,
                                                      max_num_batched_tokens=args.max_batch_tokens))

    def run(engine) -> None:
        from batchlm.engine.sampling import SamplingParams

        engine.generate([requests[0].prompt_ids], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        tokens: list[list[int]] = [[] for _ in requests]
        ttft = [0.0] * len(requests)
        e2e = [0.0] * len(requests)
        t0 = time.perf_counter()
        for r in requests:
            engine.add_request(f"r{r.index}", r.prompt_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
        while engine.has_unfinished():
            outputs = engine.step()
            now = now_since(t0)
            for out in outputs:
                i = int(out.request_id[1:])
                if out.token_ids and not tokens[i]:
                    ttft[i] = now
                tokens[i].extend(out.token_ids)
                if out.finished:
                    e2e[i] = now
        result.update(tokens=tokens, ttft_s=ttft, e2e_s=e2e, wall_s=now_since(t0),
                      notes=f"EngineConfig(max_num_seqs={args.max_num_seqs}, num_threads={args.threads}, "
                            f"max_num_batched_tokens={args.max_batch_tokens})")

    worker = threading.Thread(target=lambda: run(build()), name="batchlm-engine")
    worker.start()
    worker.join()
    if "tokens" not in result:
        raise RuntimeError("the engine thread ended without a result (see its traceback above)")
    return result
