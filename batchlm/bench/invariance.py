"""Does a request get the same greedy tokens whatever shares its batch? In process, for one dtype.

    batchlm-bench invariance [--dtype bfloat16] [--num-requests 32] [--max-tokens 160]

Runs the seeded workload (batchlm.bench.workload, outputs capped at --max-tokens) four ways on one loaded
model: every request alone, continuous batching with 8 and with 64 sequences in flight (prompts
chunked and mixed with decodes), and request-level batches of 8 (BatchGenerator, padded rows). For
each batched run it prints how many requests' tokens differ from their alone run and at which
generated token each first differs. The tests assert 0 for the default dtype; this script measures
it for any other.
"""

from __future__ import annotations

import argparse

from batchlm.bench.workload import WorkloadSpec, build_requests
from batchlm.engine.batch_generator import BatchGenerator
from batchlm.engine.engine import LLMEngine, load_parts
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.paths import TINY_MODEL_DIR


def first_differences(reference: list[list[int]], other: list[list[int]]) -> list[int]:
    """For each request whose tokens differ, the index of the first differing token."""
    return [next(j for j, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
            for a, b in zip(reference, other) if a != b]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the device's default)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160, help="cap on each request's output length")
    p.add_argument("--model-dir", default=str(TINY_MODEL_DIR))
    args = p.parse_args()
    requests = build_requests(WorkloadSpec(num_requests=args.num_requests))
    prompts = [r.prompt for r in requests]
    params = [SamplingParams(max_tokens=min(r.max_tokens, args.max_tokens), ignore_eos=True) for r in requests]
    config = EngineConfig(dtype=args.dtype)
    parts = load_parts(args.model_dir, config)

    engine = LLMEngine.from_parts(*parts, config)
    alone = [engine.generate([prompt], q)[0].token_ids for prompt, q in zip(prompts, params)]
    runs = {
        "continuous, 8 in flight": [o.token_ids for o in engine.generate(prompts, params)],
        "continuous, 64 in flight": [o.token_ids for o in LLMEngine.from_parts(
            *parts, EngineConfig(dtype=args.dtype, max_num_seqs=64)).generate(prompts, params)],
    }
    generator = BatchGenerator(*parts, config)
    runs["request-level, batches of 8"] = [
        o.token_ids for i in range(0, len(prompts), 8)
        for o in generator.generate(list(zip(prompts[i:i + 8], params[i:i + 8])))]

    print(f"dtype {config.resolved_dtype}, {len(prompts)} requests, {sum(map(len, alone))} tokens alone")
    print("| batched run | requests that differ from alone | first differing token of each |\n|---|---|---|")
    for name, tokens in runs.items():
        firsts = first_differences(alone, tokens)
        print(f"| {name} | {len(firsts)} of {len(prompts)} | {', '.join(map(str, firsts)) or '-'} |")


if __name__ == "__main__":
    main()
