"""Benchmark the engine alone, in process: decode tokens/s per batch size and prefill tokens/s.

    batchlm-bench engine [models/tiny-random] [--json out.json] [--threads 2]

Decode: B sequences with ~`--context` tokens of context, ignore_eos; only steady-state steps (every
sequence decoding one token) are timed. Prefill: `--prefill-prompts` prompts of `--prefill-len` tokens,
timed until every prompt has its first token. Each point is the best of `--repeats` runs (the CPU may be
shared). The model dir is created with write_default_checkpoint if missing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from batchlm.engine.engine import LLMEngine, load_parts
from batchlm.engine.engine_config import ATTENTION_BACKENDS, EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.model.checkpoint import write_default_checkpoint

BATCHES = (1, 2, 4, 8, 16, 32)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", default="models/tiny-random")
    p.add_argument("--json", dest="json_path", help="also write the results here")
    p.add_argument("--threads", type=int, default=EngineConfig().num_threads)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the device's default)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention path (EngineConfig.attention); the one used is printed")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--context", type=int, default=128, help="prompt tokens before decode is timed")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-prompts", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--budget", type=int, default=EngineConfig().max_num_batched_tokens,
                   help="max_num_batched_tokens (per-step token budget)")
    return p.parse_args()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def make_engine(parts, args, num_seqs: int, tokens_per_seq: int) -> LLMEngine:
    blocks = max(EngineConfig().num_kv_blocks, num_seqs * (-(-tokens_per_seq // 16)))
    config = EngineConfig(num_threads=args.threads, dtype=args.dtype, max_num_seqs=num_seqs,
                          num_kv_blocks=blocks, max_num_batched_tokens=args.budget, max_model_len=tokens_per_seq)
    return LLMEngine.from_parts(*parts, config)


def time_decode(parts, args, batch: int) -> float:
    """Seconds for `args.steps` steady-state decode steps at this batch size."""
    # NOTE: the first sequences decode while later ones still prefill, so leave room past `steps`.
    max_tokens = 2 * args.steps + 64
    engine = make_engine(parts, args, batch, args.context + max_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts(batch, args.context, engine.vocab_size, seed=batch)):
        engine.add_request(f"d{i}", ids, params)
    while not is_pure_decode(engine.stats(), batch):
        engine.step()  # prefill, until one step feeds exactly one token to every sequence
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
        assert is_pure_decode(engine.stats(), batch), "not a pure decode step"
    return time.perf_counter() - start


def is_pure_decode(stats, batch: int) -> bool:
    return stats.last_num_seqs == stats.last_num_tokens == batch and stats.num_waiting == 0


def time_prefill(parts, args) -> float:
    """Seconds until every prefill prompt has its first token."""
    n, length = args.prefill_prompts, args.prefill_len
    engine = make_engine(parts, args, n, length + 1)
    for i, ids in enumerate(prompts(n, length, engine.vocab_size, seed=99)):
        engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def best(fn, repeats: int) -> float:
    fn()  # warm-up: first calls with new shapes are slower
    return min(fn() for _ in range(repeats))


def main() -> None:
    args = parse_args()
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"writing the default model to {model_dir}", file=sys.stderr)
        write_default_checkpoint(model_dir, seed=0)
    parts = load_parts(str(model_dir), EngineConfig(num_threads=args.threads, dtype=args.dtype,
                                                    attention=args.attention))
    args.attention_used = "kernel" if parts[0].attention_kernel else "torch"
    args.linear_used = parts[0].linear_backend
    args.pointwise_used = parts[0].pointwise_backend
    rows = []
    for batch in args.batches:
        seconds = best(lambda: time_decode(parts, args, batch), args.repeats)
        rows.append({"batch": batch, "tokens_per_s": batch * args.steps / seconds,
                     "ms_per_step": 1000 * seconds / args.steps})
        print(f"batch {batch:>3}: {rows[-1]['tokens_per_s']:8.1f} tok/s", file=sys.stderr)
    prefill_s = best(lambda: time_prefill(parts, args), args.repeats)
    prefill = {"prompts": args.prefill_prompts, "prompt_len": args.prefill_len, "budget": args.budget,
               "tokens_per_s": args.prefill_prompts * args.prefill_len / prefill_s}
    by_batch = {r["batch"]: r["tokens_per_s"] for r in rows}
    ratio = by_batch[8] / by_batch[1] if 1 in by_batch and 8 in by_batch else None
    print(render(args, rows, prefill, ratio))
    if args.json_path:
        result = {"model_dir": str(model_dir), "threads": args.threads,
                  "dtype": EngineConfig(dtype=args.dtype).resolved_dtype, "attention": args.attention_used,
                  "linear": args.linear_used, "pointwise": args.pointwise_used, "context": args.context,
                  "steps": args.steps, "decode": rows, "prefill": prefill, "batch8_over_batch1": ratio}
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")


def render(args, rows, prefill, ratio) -> str:
    lines = [f"Engine decode, context ~{args.context} tokens, {args.threads} threads, "
             f"{EngineConfig(dtype=args.dtype).resolved_dtype}, {args.attention_used} attention, "
             f"{args.linear_used} linears, {args.pointwise_used} element-wise ops, best of {args.repeats} x "
             f"{args.steps} steps", "",
             "| batch | decode tok/s | ms / step |", "|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.2f} |" for r in rows]
    lines += ["", f"Prefill: {prefill['prompts']} x {prefill['prompt_len']} tokens, budget "
              f"{prefill['budget']} tokens/step: {prefill['tokens_per_s']:.1f} tok/s"]
    if ratio is not None:
        lines.append(f"Decode batch 8 / batch 1: {ratio:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
