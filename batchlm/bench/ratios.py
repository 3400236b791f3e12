"""The engine's own throughput ratios, with the strategies interleaved so the machine's drift falls on all.

    batchlm-bench ratios [--num-requests 256] [--same-kv-seqs 64] [--dtype float32|bfloat16]

One model, three engines in this process, on this thread: request-level batching (batches of 8 in
arrival order, finished rows kept as padding), continuous batching with 8 sequences and continuous
batching with up to `--same-kv-seqs` on the same KV blocks (the compare's same-KV variant). Each
request-level batch runs to completion; then each continuous engine steps for a share of the time that
batch took (0.4 and 0.25 of it), and so on to the last batch, so every strategy is timed in every
minute of the run. The continuous engines are kept saturated: their waiting queues are topped up from
the same seeded requests, in order and round again, and they run 3 s before timing starts (so in the timed
window they serve the same distribution of lengths as request-level batching, not the very same
requests). Prints each strategy's output tokens/s and its ratio to request-level batching's over the
whole run. `batchlm-bench predict` predicts these ratios from timed forward passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time

from batchlm.bench.workload import WorkloadRequest, WorkloadSpec, build_requests
from batchlm.engine.batch_generator import BatchGenerator
from batchlm.engine.engine import LLMEngine, load_parts
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.paths import TINY_MODEL_DIR

BATCH = 8
RAMP_S = 3.0


def params(request: WorkloadRequest) -> SamplingParams:
    return SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)


class Saturated:
    """A continuous engine whose waiting queue never runs dry: it is topped up to `depth` requests. It
    steps for `share` of each request-level batch's time."""

    def __init__(self, engine: LLMEngine, requests: list[WorkloadRequest], depth: int, share: float) -> None:
        self.engine, self.depth, self.share = engine, depth, share
        self._feed = itertools.cycle(requests)
        self._ids = itertools.count()
        self.tokens, self.seconds, self.steps, self.seqs = 0, 0.0, 0, 0

    def run_for(self, seconds: float, count: bool = True) -> tuple[int, float]:
        """Step for `seconds`; returns (tokens generated, seconds taken) and adds them up when `count`."""
        start, generated = time.perf_counter(), self.engine.stats().total_generated_tokens
        while time.perf_counter() - start < seconds:
            while self.engine.stats().num_waiting < self.depth:
                request = next(self._feed)
                self.engine.add_request(f"q{next(self._ids)}", request.prompt, params(request))
            self.engine.step()
            if count:
                self.steps += 1
                self.seqs += self.engine.stats().last_num_seqs
        tokens = self.engine.stats().total_generated_tokens - generated
        taken = time.perf_counter() - start
        if count:
            self.tokens += tokens
            self.seconds += taken
        return tokens, taken


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--same-kv-seqs", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    args = ap.parse_args()
    if args.num_requests < BATCH or args.same_kv_seqs < 1:
        ap.error(f"--num-requests must be at least {BATCH} and --same-kv-seqs positive")
    requests = build_requests(WorkloadSpec(num_requests=args.num_requests))
    config = EngineConfig(dtype=args.dtype)
    model, tokenizer = load_parts(TINY_MODEL_DIR, config)
    request_level = BatchGenerator(model, tokenizer, config).engine
    wide = dataclasses.replace(config, max_num_seqs=args.same_kv_seqs)
    continuous = {
        f"continuous ({BATCH} in flight)": Saturated(LLMEngine.from_parts(model, tokenizer, config), requests,
                                                     BATCH, share=0.4),
        f"same KV ({args.same_kv_seqs} at most)": Saturated(LLMEngine.from_parts(model, tokenizer, wide), requests,
                                                            args.same_kv_seqs, share=0.25),
    }
    for engine in [request_level] + [c.engine for c in continuous.values()]:
        engine.generate(["warm up"], SamplingParams(max_tokens=8, ignore_eos=True))
    for saturated in continuous.values():
        saturated.run_for(RAMP_S, count=False)
    tokens, seconds = 0, 0.0
    for i in range(0, len(requests), BATCH):
        start, generated = time.perf_counter(), request_level.stats().total_generated_tokens
        for request in requests[i:i + BATCH]:
            request_level.add_request(f"b{request.index}", request.prompt, params(request))
        while request_level.has_unfinished():
            request_level.step()
        taken = time.perf_counter() - start
        tokens += request_level.stats().total_generated_tokens - generated
        seconds += taken
        for saturated in continuous.values():
            saturated.run_for(taken * saturated.share)
    base = tokens / seconds
    print("| strategy | output tok/s | seconds timed | sequences a step | / request-level |")
    print("|---|---|---|---|---|")
    print(f"| request-level ({BATCH} per batch) | {base:.1f} | {seconds:.1f} | - | - |")
    for name, saturated in continuous.items():
        rate = saturated.tokens / saturated.seconds
        print(f"| {name} | {rate:.1f} | {saturated.seconds:.1f} | "
              f"{saturated.seqs / max(saturated.steps, 1):.2f} | {rate / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
