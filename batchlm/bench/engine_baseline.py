"""The engine's own throughput, in process and without Triton, on a benchmark workload.

Every request is queued at once (saturation) and the engine is stepped until all finish; this is
the ceiling that serving through Triton is compared with (same EngineConfig, same requests). As for
a served run (batchlm.bench.served.metrics_timeline.saturated_window), `saturated` counts the tokens and time up to
the step that admits the last waiting request: the drain after it is not saturation.
"""

from __future__ import annotations

import time
from pathlib import Path

from batchlm.bench.workload import WorkloadRequest
from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams


def engine_throughput(model_dir: str | Path, config: EngineConfig,
                      requests: list[WorkloadRequest]) -> dict:
    """Output tokens/s and requests/s of the engine alone, after a short warm-up."""
    result = run_to_completion(LLMEngine(model_dir, config), requests)
    result["config"] = config.__dict__.copy()
    return result


def run_to_completion(engine: LLMEngine, requests: list[WorkloadRequest]) -> dict:
    """Warm `engine` up, queue every request at once and step until all finish, on the calling thread."""
    engine.generate(["warm up"], SamplingParams(max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    for r in requests:
        engine.add_request(f"r{r.index}", r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos))
    tokens = steps = 0
    saturated = None
    lengths = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
            if out.finished:
                lengths[out.request_id] = out.num_output_tokens
        steps += 1
        if saturated is None and engine.stats().num_waiting == 0:
            duration = time.perf_counter() - start
            saturated = {"output_tokens": tokens, "duration_s": duration,
                         "output_token_throughput": tokens / duration}
    elapsed = time.perf_counter() - start
    return {"output_tokens": tokens, "duration_s": elapsed, "steps": steps,
            "output_token_throughput": tokens / elapsed, "request_throughput": len(requests) / elapsed,
            "saturated": saturated, "output_lengths": [lengths[f"r{r.index}"] for r in requests]}
