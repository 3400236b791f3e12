"""What this machine's step costs allow: the throughput targets' ratios predicted from timed forward passes.

    batchlm-bench predict [--seqs 8,16,24,32,40,48,64] [--same-kv-seqs 40] [--rounds 5]
                          [--iters 30] [--threads 2] [--num-requests N] [--dtype float32|bfloat16]

Times, in process and interleaved round by round (this VM's speed drifts, so every figure of a round
comes from the same minute): a prefill of 8 prompts of the workload's mean length, a request-level
decode step of 8 rows at request-level batching's mean context, and a decode step of n rows at
continuous batching's mean context for each n of `--seqs`. Each figure is the median over the rounds
of each round's 20th-percentile step (`batchlm.bench.forward.time_step`). It then predicts, with
`batchlm.bench.step_cost_model`, each continuous configuration's output tokens/s over request-level
batching's on the default workload (its expectations; with `--num-requests N`, the lengths of its
first N seeded requests, which `batchlm-bench ratios` and the compare run), with the prompts as they
cost here and with free prompts (the step-count view), and what a decode token would have to cost for
the same-KV target. `--same-kv-seqs` is the n that the compare's same-KV memory holds (37 to 40
sequences a step in its runs). Forward passes only: no scheduler, server or client, and the drain at a
run's end left out (`batchlm-bench ratios` runs the engine itself).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from batchlm.bench import step_cost_model as scm
from batchlm.bench.forward import decode_batch, prefill_batch, time_step
from batchlm.bench.workload import WorkloadSpec, build_requests
from batchlm.model.checkpoint import load_model
from batchlm.model.kv_cache import KVCache
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import TINY_MODEL_DIR

BLOCK = 16
TARGETS = {8: 2.3}  # continuous at 8 sequences / static: the line `make compare` checks
SAME_KV_TARGET = 5.0


def measure(model_dir: Path, seqs: list[int], rounds: int, iters: int, lengths: scm.Lengths,
            dtype: torch.dtype) -> scm.StepCosts:
    model = load_model(model_dir, dtype=dtype)
    prompt_len = round(lengths.prompt)
    ctx_static, ctx_cont = round(lengths.request_level_context), round(lengths.continuous_context)
    rows = max(max(seqs), scm.REQUEST_LEVEL_BATCH)
    tokens = max(prompt_len, ctx_static, ctx_cont)
    cache = KVCache(model.config, num_blocks=rows * -(-tokens // BLOCK), block_size=BLOCK, dtype=dtype)
    runs = {"prefill": prefill_batch(scm.REQUEST_LEVEL_BATCH, prompt_len, BLOCK),
            "request-level": decode_batch(scm.REQUEST_LEVEL_BATCH, ctx_static, BLOCK)}
    runs.update({n: decode_batch(n, ctx_cont, BLOCK) for n in seqs})
    ms: dict = {key: [] for key in runs}
    for _ in range(rounds):
        for key, batch in runs.items():
            ms[key].append(1e3 * time_step(model, cache, batch, max(3, iters // 5) if key == "prefill" else iters))
    med = {key: statistics.median(values) for key, values in ms.items()}
    return scm.StepCosts(prompt_token_ms=med["prefill"] / (scm.REQUEST_LEVEL_BATCH * prompt_len),
                         request_level_step_ms=med["request-level"],
                         decode_step_ms={n: med[n] for n in seqs})


def report(workload: str, lengths: scm.Lengths, costs: scm.StepCosts, same_kv_seqs: int) -> str:
    prompt_ms = lengths.prompt * costs.prompt_token_ms
    lines = [
        f"workload: {workload}: prompts {lengths.prompt:.1f} tokens, outputs {lengths.output:.1f}, longest of "
        f"{scm.REQUEST_LEVEL_BATCH} {lengths.longest_of_batch:.1f} (means); step-count bound "
        f"{lengths.step_count_bound:.2f}",
        f"prompt token: {costs.prompt_token_ms:.3f} ms; request-level decode step ({scm.REQUEST_LEVEL_BATCH} rows, "
        f"context {round(lengths.request_level_context)}): {costs.request_level_step_ms:.2f} ms",
        f"per request: request-level {scm.request_ms(lengths, costs):.1f} ms of forward passes, "
        f"{100 * prompt_ms / scm.request_ms(lengths, costs):.0f}% of it the prompt",
        "",
        f"| continuous, sequences a step (context {round(lengths.continuous_context)}) | decode step ms | "
        "ms a decode token | ms per request | prompt share | / request-level | / request-level, free prompts |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, step in sorted(costs.decode_step_ms.items()):
        per_request = scm.request_ms(lengths, costs, n)
        lines.append(f"| {n} | {step:.2f} | {step / n:.3f} | {per_request:.1f} | "
                     f"{100 * prompt_ms / per_request:.0f}% | {scm.ratio(lengths, costs, n):.2f} | "
                     f"{scm.ratio(lengths, costs, n, prompts=False):.2f} |")
    lines.append("")
    for n, target in TARGETS.items():
        if n in costs.decode_step_ms:
            lines.append(f"continuous at {n} / static, predicted in process: {scm.ratio(lengths, costs, n):.2f} "
                         f"(target {target})")
    if same_kv_seqs in costs.decode_step_ms:
        lines.append(f"same KV memory, {same_kv_seqs} sequences a step: predicted in process "
                     f"{scm.ratio(lengths, costs, same_kv_seqs):.2f} (target {SAME_KV_TARGET})")
    cheapest = min(costs.decode_step_ms, key=lambda n: costs.decode_step_ms[n] / n)
    needed = scm.decode_token_ms_needed(lengths, costs, SAME_KV_TARGET)
    lines.append(f"for {SAME_KV_TARGET}, a continuous decode token may cost at most {needed:.3f} ms with the prompts "
                 f"as they cost here; the cheapest of these sizes, {cheapest} sequences, costs "
                 f"{costs.decode_step_ms[cheapest] / cheapest:.3f} ms "
                 f"(ratio {scm.ratio(lengths, costs, cheapest):.2f})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=TINY_MODEL_DIR)
    ap.add_argument("--seqs", default="8,16,24,32,40,48,64", help="continuous batching's sequences a step")
    ap.add_argument("--same-kv-seqs", type=int, default=40,
                    help="sequences a step that the same KV memory holds (added to --seqs)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30, help="decode steps timed per size and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=0,
                    help="use the means of the workload's first N requests instead of its expectations")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    try:
        seqs = sorted({int(s) for s in args.seqs.split(",")} | {args.same_kv_seqs})
    except ValueError:
        ap.error(f"--seqs must be comma-separated integers, got {args.seqs!r}")
    if seqs[0] < 1 or min(args.rounds, args.iters, args.threads) < 1 or args.num_requests < 0:
        ap.error("--seqs, --same-kv-seqs, --rounds, --iters and --threads must be positive, "
                 "--num-requests not negative")
    torch.set_num_threads(args.threads)
    bos = Tokenizer.from_dir(args.model).add_bos
    if args.num_requests:
        spec = WorkloadSpec(num_requests=args.num_requests)
        lengths = scm.Lengths.of_requests(build_requests(spec, args.model), bos)
        workload = f"the first {args.num_requests} requests of the default spec"
    else:
        lengths = scm.Lengths.of_spec(WorkloadSpec(), bos)
        workload = "the default spec's expectations"
    costs = measure(args.model, seqs, args.rounds, args.iters, lengths, getattr(torch, args.dtype))
    print(f"{args.dtype}, {args.threads} threads")
    print(report(workload, lengths, costs, args.same_kv_seqs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
