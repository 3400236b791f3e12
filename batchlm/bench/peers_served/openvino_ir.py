"""The checkpoint as a float32 OpenVINO IR, written once per digest by optimum-intel's exporter, which
lives in a folder of its own (scripts/install_optimum_intel.sh: it pins an older transformers than .venv's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from batchlm.bench.peers.checkpoint import CACHE_DIR, checkpoint_digest

OPTIMUM_SITE = CACHE_DIR / "optimum-intel-site"
INSTALL_HINT = "scripts/install_optimum_intel.sh (make bench-peers-served runs it)"


class IrUnavailable(RuntimeError):
    """No IR can be written here: the exporter is not installed, or it failed (the message says which)."""


def float32_ir(hf_dir: Path, timeout: float = 1800.0) -> Path:
    """The folder of the float32 IR of the Hugging Face folder `hf_dir` (openvino_model.xml and the
    tokenizer models beside it), exported on first use into .cache/peers/."""
    out = CACHE_DIR / f"ov-ir-fp32-{checkpoint_digest(hf_dir)}"
    if (out / "openvino_model.xml").is_file():
        return out
    if not (OPTIMUM_SITE / "optimum" / "intel").is_dir():
        raise IrUnavailable(f"optimum-intel is not installed in {OPTIMUM_SITE}: {INSTALL_HINT}")
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    cmd = [sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(hf_dir),
           "--task", "text-generation-with-past", "--weight-format", "fp32", str(tmp)]
    env = {**os.environ, "PYTHONPATH": str(OPTIMUM_SITE), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print(f"exporting {hf_dir} as a float32 OpenVINO IR (optimum-intel; minutes on 2 cores)", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not (tmp / "openvino_model.xml").is_file():
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise IrUnavailable(f"optimum-intel's export failed (exit {proc.returncode}): {tail}")
    tmp.rename(out)
    return out
