"""What a step costs in process: decode-only steps against steps that also prefill, per strategy.

    python scripts/step_costs.py [--num-requests 128] [--dtype bfloat16] [--attention auto|kernel|torch]
                                 [--linear auto|kernel|onednn] [--pointwise auto|kernel|torch]
                                 [--decode-groups 4] [--same-kv-seqs 64]

Runs the seeded workload (client.workload) through the engine on this thread: request-level
(BatchGenerator, batches of 8 in arrival order, finished rows kept as padding), continuous (every
request queued at once, 8 sequences in flight) and, with `--same-kv-seqs N`, continuous with up to N
sequences on the same KV blocks (the compare's same-KV-memory variant). For each it prints output tok/s
over the whole run and while saturated (continuous: up to the step that admits the last request, as
client.engine_baseline reads it), sequences per step while saturated, the count and mean time of
decode-only steps (every scheduled sequence feeds one token) and of steps that also feed prompt tokens,
and the share of the run spent in the latter; then each continuous run's saturated ratio to
request-level. `--attention torch` uses SDPA instead of the native kernel; with it, `--decode-groups 1`
pads all decode queries to one length (batchlm.attention). `--linear onednn` multiplies with oneDNN
instead of the batchlm linear kernel (EngineConfig.linear), `--pointwise torch` runs the element-wise ops
with torch's instead of the batchlm kernels (EngineConfig.pointwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchlm import attention  # noqa: E402
from batchlm.batch_generator import BatchGenerator  # noqa: E402
from batchlm.engine import LLMEngine  # noqa: E402
from batchlm.engine_config import ATTENTION_BACKENDS, LINEAR_BACKENDS, POINTWISE_BACKENDS, EngineConfig  # noqa: E402
from batchlm.sampling import SamplingParams  # noqa: E402
from client.workload import WorkloadSpec, build_requests  # noqa: E402


def measure(engine: LLMEngine, batches: list[list], continuous: bool) -> dict:
    """Queue each batch and step until it is done; time every step by kind.

    Continuous batching gets one batch (every request); its saturated figures stop at the step that
    admits the last waiting request, as the compare reads a served run (the drain after it is not
    saturation). Request-level batching keeps every batch full, so its whole run is its saturation.
    """
    engine.generate(["warm up"], SamplingParams(max_tokens=8, ignore_eos=True))
    times = {"decode": [], "prefill": []}
    seqs = 0
    saturated = None  # (tokens, seconds, steps, sequences) when the last waiting request was admitted
    tokens, start = 0, time.perf_counter()
    for batch in batches:
        for r in batch:
            engine.add_request(f"r{r.index}", r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
        while engine.has_unfinished():
            t = time.perf_counter()
            tokens += sum(len(out.token_ids) for out in engine.step())
            stats = engine.stats()
            seqs += stats.last_num_seqs
            kind = "decode" if stats.last_num_tokens == stats.last_num_seqs else "prefill"
            times[kind].append(time.perf_counter() - t)
            if continuous and saturated is None and stats.num_waiting == 0:
                saturated = (tokens, time.perf_counter() - start, sum(len(v) for v in times.values()), seqs)
    elapsed = time.perf_counter() - start
    steps = sum(len(v) for v in times.values())
    sat_tokens, sat_elapsed, sat_steps, sat_seqs = saturated or (tokens, elapsed, steps, seqs)
    prompt_time = sum(times["prefill"])
    row = {"output tok/s": round(tokens / elapsed, 1),
           "saturated tok/s": round(sat_tokens / sat_elapsed, 1),
           "saturated seqs/step": round(sat_seqs / max(sat_steps, 1), 2)}
    for kind, values in times.items():
        row[f"{kind} steps"] = len(values)
        row[f"{kind} ms/step"] = round(1000 * sum(values) / max(len(values), 1), 2)
    row["time in steps with prompt tokens"] = f"{100 * prompt_time / elapsed:.0f}%"
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the device's default)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--linear", default="auto", choices=LINEAR_BACKENDS)
    p.add_argument("--pointwise", default="auto", choices=POINTWISE_BACKENDS)
    p.add_argument("--decode-groups", type=int, default=attention.MAX_DECODE_GROUPS)
    p.add_argument("--same-kv-seqs", type=int, default=0,
                   help="also continuous batching with this many sequences at most on the same KV blocks")
    args = p.parse_args()
    attention.MAX_DECODE_GROUPS = args.decode_groups
    requests = build_requests(WorkloadSpec(num_requests=args.num_requests))
    model_dir = ROOT / "models" / "default"
    config = EngineConfig(dtype=args.dtype, attention=args.attention, linear=args.linear, pointwise=args.pointwise)
    batches_of_8 = [requests[i:i + 8] for i in range(0, len(requests), 8)]
    rows = {
        "request-level (8 per batch)": measure(BatchGenerator.from_dir(model_dir, config).engine, batches_of_8,
                                               continuous=False),
        "continuous (8 in flight)": measure(LLMEngine(model_dir, config), [requests], continuous=True),
    }
    if args.same_kv_seqs:
        wide = dataclasses.replace(config, max_num_seqs=args.same_kv_seqs)
        rows[f"continuous ({args.same_kv_seqs} at most, same KV blocks)"] = measure(
            LLMEngine(model_dir, wide), [requests], continuous=True)
    keys = list(next(iter(rows.values())))
    print("| strategy | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |")
    base = rows["request-level (8 per batch)"]["saturated tok/s"]
    for name, row in list(rows.items())[1:]:
        print(f"{name} / request-level, saturated: {row['saturated tok/s'] / base:.2f}")


if __name__ == "__main__":
    main()
