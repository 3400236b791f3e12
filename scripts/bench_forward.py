#!/usr/bin/env python
"""Time one decode forward of the model at several batch sizes (in process, no server).

    python scripts/bench_forward.py [--model models/default] [--context 128] [--threads 2]
                                    [--batch-sizes 1,2,4,8,16] [--dtype float32|bfloat16] [--prompt-len 0]

Prints ms per step and tokens/s per batch size, and the batch-8 / batch-1 tokens/s ratio; with
--prompt-len L also one prefill forward of each batch size's prompts (L tokens each) and its cost per
prompt token. Reports the 20th-percentile step time, which is robust to other processes sharing the cores.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchlm.checkpoint import load_model  # noqa: E402
from batchlm.forward_batch import ForwardBatch  # noqa: E402
from batchlm.kv_cache import KVCache  # noqa: E402


def decode_batch(batch_size: int, context: int, block_size: int) -> ForwardBatch:
    """`batch_size` sequences, each decoding the token at position context - 1, in disjoint blocks."""
    nb = -(-context // block_size)
    tables = torch.arange(batch_size * nb).view(batch_size, nb)  # (S, nb)
    pos = torch.full((batch_size,), context - 1)  # (S,)
    slots = tables[:, -1] * block_size + pos % block_size  # (S,)
    return ForwardBatch(
        input_ids=torch.randint(3, 1000, (batch_size,)), positions=pos, slot_mapping=slots,
        query_lens=[1] * batch_size, context_lens=[context] * batch_size, block_tables=tables,
        logits_indices=torch.arange(batch_size))


def prefill_batch(batch_size: int, prompt_len: int, block_size: int) -> ForwardBatch:
    """`batch_size` prompts of `prompt_len` tokens each, fed whole, in disjoint blocks."""
    nb = -(-prompt_len // block_size)
    tables = torch.arange(batch_size * nb).view(batch_size, nb)  # (S, nb)
    pos = torch.arange(prompt_len).repeat(batch_size)  # (T,)
    rows = torch.arange(batch_size).repeat_interleave(prompt_len)  # (T,) sequence of each token
    slots = tables[rows, pos // block_size] * block_size + pos % block_size  # (T,)
    return ForwardBatch(
        input_ids=torch.randint(3, 1000, (batch_size * prompt_len,)), positions=pos, slot_mapping=slots,
        query_lens=[prompt_len] * batch_size, context_lens=[prompt_len] * batch_size, block_tables=tables,
        logits_indices=torch.arange(1, batch_size + 1) * prompt_len - 1)


def time_step(model, cache: KVCache, batch: ForwardBatch, iters: int) -> float:
    for _ in range(5):
        model(batch, cache)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        model(batch, cache)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 5]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("models/default"))
    ap.add_argument("--context", type=int, default=128, help="tokens in each sequence's KV cache")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--prompt-len", type=int, default=0, help="also time a prefill of this many tokens a prompt")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, dtype=dtype)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    block_size = 16
    tokens = max(args.context, args.prompt_len)
    cache = KVCache(model.config, num_blocks=max(sizes) * -(-tokens // block_size), block_size=block_size,
                    dtype=dtype)
    ms = {}
    for s in sizes:
        ms[s] = 1e3 * time_step(model, cache, decode_batch(s, args.context, block_size), args.iters)
        line = f"batch {s:3d}: {ms[s]:7.2f} ms/step  {1e3 * s / ms[s]:8.1f} tokens/s"
        if args.prompt_len > 0:
            prefill = 1e3 * time_step(model, cache, prefill_batch(s, args.prompt_len, block_size),
                                      max(3, args.iters // 10))
            line += f"  prefill {prefill:8.1f} ms ({prefill / (s * args.prompt_len):.3f} ms per prompt token)"
        print(line)
    if 1 in ms and 8 in ms:
        print(f"tokens/s ratio batch 8 / batch 1: {8 * ms[1] / ms[8]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
