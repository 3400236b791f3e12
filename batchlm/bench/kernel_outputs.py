"""Save what the kernels and the model compute on fixed inputs, or compare two such files to the bit.

    batchlm-bench kernel-outputs save OUT.pt [--dtype float32|bfloat16]
    batchlm-bench kernel-outputs compare A.pt B.pt

`save` loads this checkout's kernel library (built by `python -m batchlm.kernels`) and the default model,
and stores: silu_mul on seeded inputs with saturated, zero, infinite and NaN entries (float32 and
bfloat16), and the model's logits for 8 prompts of 100 tokens and for decode steps of 1, 8 and 40
sequences over a seeded KV cache of 160 positions each. Every input comes from a fixed seed, so two
checkouts (say, before and after a change of kernel code or compiler flags, each with its own library)
can be compared with `compare`, which prints, per output, how many elements differ in their bits (NaNs
count as equal to NaNs: their sign and payload are not part of any contract) and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from batchlm import kernels
from batchlm.bench.forward import decode_batch, prefill_batch
from batchlm.model.checkpoint import load_model
from batchlm.model.kv_cache import KVCache
from batchlm.paths import TINY_MODEL_DIR

BLOCK = 16
CONTEXT = 160


def outputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if not kernels.load():
        raise SystemExit(f"kernel library not built: {kernels.library_path()} (run python -m batchlm.kernels)")
    torch.set_num_threads(2)
    out = {}
    gu = torch.randn(64, 2 * 1408, generator=torch.Generator().manual_seed(0)) * 6
    gu[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -200.0, -87.0, -86.99, 0.0, -0.0])
    gu[1, :1408] = torch.linspace(-120, 30, 1408)  # across the exp's clamp at -87
    out["silu_mul float32"] = torch.ops.batchlm.silu_mul(gu)
    out["silu_mul bfloat16"] = torch.ops.batchlm.silu_mul(gu.bfloat16())
    model = load_model(TINY_MODEL_DIR, dtype=dtype, linear="auto", pointwise="auto")
    cache = KVCache(model.config, num_blocks=40 * (CONTEXT // BLOCK), block_size=BLOCK, dtype=dtype)
    torch.manual_seed(1)
    cache.storage.copy_(torch.randn(cache.storage.shape) * 2)
    torch.manual_seed(3)
    out["prefill 8 x 100"] = model(prefill_batch(8, 100, BLOCK), cache)
    for n in (1, 8, 40):
        torch.manual_seed(n)
        out[f"decode {n}"] = model(decode_batch(n, CONTEXT, BLOCK), cache)
    return out


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return a.numel()
    a, b = a.float(), b.float()  # exact for float32 and bfloat16
    same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
    return int((~same).sum())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("out", type=Path)
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    if args.cmd == "save":
        torch.save(outputs(getattr(torch, args.dtype)), args.out)
        print(f"saved {args.out} (library {kernels.library_path().name})")
        return 0
    a, b = torch.load(args.a), torch.load(args.b)
    bad = 0
    for name in a:
        n = differing(a[name], b[name]) if name in b else a[name].numel()
        bad += n
        print(f"{name}: {n} of {a[name].numel()} elements differ")
    return 1 if bad or set(a) != set(b) else 0


if __name__ == "__main__":
    sys.exit(main())
