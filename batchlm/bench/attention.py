"""One layer's decode attention, native kernel against the torch (SDPA) path, in process.

    batchlm-bench attention [--seqs 8 64] [--context 128 400] [--dtype float32 bfloat16]

For each (dtype, sequences, context) it builds a KV cache of the default model's shape (block size 16,
blocks handed out shuffled, as after some traffic), writes one decode token per sequence and times
`batchlm.model.attention.paged_attention` both ways (best of --repeats x --calls calls), and checks that the two
paths agree (max abs difference). Contexts vary +-50% around --context, so the torch path pays for padding
the way it does in a real step.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from batchlm import kernels
from batchlm.model.attention import AttentionMetadata, paged_attention
from batchlm.model.forward_batch import ForwardBatch
from batchlm.model.kv_cache import KVCache
from batchlm.model.model_config import ModelConfig
from batchlm.paths import TINY_MODEL_DIR


def decode_batch(contexts: list[int], block_size: int, num_blocks: int, rng: random.Random) -> ForwardBatch:
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    width = max(-(-c // block_size) for c in contexts)
    tables, slots = [], []
    for c in contexts:
        blocks = [pool.pop() for _ in range(-(-c // block_size))]
        tables.append(blocks + [0] * (width - len(blocks)))
        slots.append(blocks[(c - 1) // block_size] * block_size + (c - 1) % block_size)
    S = len(contexts)
    return ForwardBatch(input_ids=torch.zeros(S, dtype=torch.long), positions=torch.tensor([c - 1 for c in contexts]),
                        slot_mapping=torch.tensor(slots), query_lens=[1] * S, context_lens=contexts,
                        block_tables=torch.tensor(tables), logits_indices=torch.arange(S))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[8, 64])
    p.add_argument("--context", type=int, nargs="+", default=[128, 400])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", default=str(TINY_MODEL_DIR))
    args = p.parse_args()
    if not kernels.load():
        sys.exit(f"kernel not built ({kernels.library_path()}): run python -m batchlm.kernels")
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_dir(args.model_dir)
    H, KVH, hd, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    print(f"one layer of {Path(args.model_dir).name} (H={H}, KVH={KVH}, hd={hd}), block size {bs}, "
          f"{args.threads} threads; ms per call, best of {args.repeats} x {args.calls}\n")
    print("| dtype | sequences | mean context | kernel ms | torch ms | torch / kernel | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.dtype:
        dtype = getattr(torch, name)
        for S in args.seqs:
            for context in args.context:
                rng = random.Random(0)
                contexts = [rng.randint(context // 2, context * 3 // 2) for _ in range(S)]
                num_blocks = sum(-(-c // bs) for c in contexts) * 2
                cache = KVCache(cfg, num_blocks, bs, dtype=dtype)
                g = torch.Generator().manual_seed(0)
                cache.storage.copy_(torch.randn(cache.storage.shape, generator=g).to(dtype))
                batch = decode_batch(contexts, bs, num_blocks, rng)
                q = torch.randn(S, H, hd, generator=g).to(dtype)
                k, v = torch.randn(S, KVH, hd, generator=g).to(dtype), torch.randn(S, KVH, hd, generator=g).to(dtype)
                results, times = [], []
                for use_kernel in (True, False):
                    meta = AttentionMetadata.build(batch, bs, torch.device("cpu"), use_kernel=use_kernel)
                    call = lambda: paged_attention(q, k, v, cache.k[0], cache.v[0], meta)  # noqa: E731
                    results.append(call())
                    best = float("inf")
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            call()
                        best = min(best, (time.perf_counter() - start) / args.calls)
                    times.append(1000 * best)
                diff = (results[0].float() - results[1].float()).abs().max().item()
                print(f"| {name} | {S} | {sum(contexts) / S:.0f} | {times[0]:.3f} | {times[1]:.3f} | "
                      f"{times[1] / times[0]:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
