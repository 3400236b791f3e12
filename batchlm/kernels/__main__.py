"""python -m batchlm.kernels: build the native kernels for this machine and check that they load."""

from __future__ import annotations

import subprocess
import sys

from batchlm.kernels import build, load


def main() -> int:
    try:
        path = build()
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"batchlm kernels: build failed ({exc}); the engine will use its torch path", file=sys.stderr)
        return 1
    if not load():
        print(f"batchlm kernels: built {path} but it does not load", file=sys.stderr)
        return 1
    print(f"batchlm kernels: {path.name} (torch.ops.batchlm: paged_attention, linear, pack_linear, "
          "linear_bf16, linear_is_native, linear_q, pack_linear_q, embedding_q, linear_q_is_native, linear_q8, "
          "pack_linear_q8, embedding_q8, linear_q8_is_native, rms_norm, add_rms_norm, silu_mul, rope_write_kv)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
