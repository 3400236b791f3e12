"""What a step costs in process: decode-only steps against steps that also prefill, per strategy.

    python scripts/step_costs.py [--num-requests 128] [--dtype bfloat16] [--attention auto|kernel|torch]
                                 [--decode-groups 4]

Runs the seeded workload (client.workload) through the engine twice on this thread: request-level
(BatchGenerator, batches of 8 in arrival order, finished rows kept as padding) and continuous (every
request queued at once, 8 sequences in flight). For each it prints output tok/s, and the count and
mean time of decode-only steps (every scheduled sequence feeds one token) and of steps that also feed
prompt tokens. `--attention torch` uses SDPA instead of the native kernel; with it, `--decode-groups 1`
pads all decode queries to one length (batchlm.attention).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchlm import attention  # noqa: E402
from batchlm.batch_generator import BatchGenerator  # noqa: E402
from batchlm.engine import LLMEngine  # noqa: E402
from batchlm.engine_config import EngineConfig  # noqa: E402
from batchlm.sampling import SamplingParams  # noqa: E402
from client.workload import WorkloadSpec, build_requests  # noqa: E402


def measure(engine: LLMEngine, batches: list[list]) -> dict:
    """Queue each batch and step until it is done; time every step by kind."""
    engine.generate(["warm up"], SamplingParams(max_tokens=8, ignore_eos=True))
    times = {"decode": [], "prefill": []}
    tokens, start = 0, time.perf_counter()
    for batch in batches:
        for r in batch:
            engine.add_request(f"r{r.index}", r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
        while engine.has_unfinished():
            t = time.perf_counter()
            tokens += sum(len(out.token_ids) for out in engine.step())
            stats = engine.stats()
            kind = "decode" if stats.last_num_tokens == stats.last_num_seqs else "prefill"
            times[kind].append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    row = {"output tok/s": round(tokens / elapsed, 1)}
    for kind, values in times.items():
        row[f"{kind} steps"] = len(values)
        row[f"{kind} ms/step"] = round(1000 * sum(values) / max(len(values), 1), 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the device's default)")
    p.add_argument("--attention", default="auto", choices=("auto", "kernel", "torch"))
    p.add_argument("--decode-groups", type=int, default=attention.MAX_DECODE_GROUPS)
    args = p.parse_args()
    attention.MAX_DECODE_GROUPS = args.decode_groups
    requests = build_requests(WorkloadSpec(num_requests=args.num_requests))
    model_dir = ROOT / "models" / "default"
    config = EngineConfig(dtype=args.dtype, attention=args.attention)
    rows = {
        "request-level (8 per batch)": measure(BatchGenerator.from_dir(model_dir, config).engine,
                                               [requests[i:i + 8] for i in range(0, len(requests), 8)]),
        "continuous (8 in flight)": measure(LLMEngine(model_dir, config), [requests]),
    }
    keys = list(next(iter(rows.values())))
    print("| strategy | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
