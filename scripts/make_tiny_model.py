#!/usr/bin/env python
"""Write the default random-weight Llama checkpoint (HF layout) deterministically from a seed.

    python scripts/make_tiny_model.py --out models/tiny-random --seed 0

Idempotent: when the directory already holds exactly these files (checked by sha256) it does nothing.
Nothing is downloaded; the tokenizer is trained on a synthetic corpus generated in code.
"""

import argparse
import sys
import time
from pathlib import Path

from batchlm.model.checkpoint import default_checkpoint_is_current, write_default_checkpoint


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models/tiny-random"), help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="seed for weights and tokenizer corpus")
    ap.add_argument("--force", action="store_true", help="rewrite even if the files are current")
    args = ap.parse_args()
    if not args.force and default_checkpoint_is_current(args.out, args.seed):
        print(f"[make_tiny_model] {args.out} is current (seed {args.seed}); nothing to do")
        return 0
    start = time.perf_counter()
    write_default_checkpoint(args.out, args.seed)
    print(f"[make_tiny_model] wrote {args.out} (seed {args.seed}) in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
