#!/usr/bin/env python3
"""Build the TensorRT-LLM engine that the `tensorrt_llm` model serves, from a Hugging Face Llama checkpoint.

    python3 scripts/build_trtllm_engine.py [--model-dir models/default] [--out engines/trtllm] [--dtype float16]
    python3 scripts/build_trtllm_engine.py --dry-run      # print the plan; needs no TensorRT-LLM

GPU only: run it with the interpreter that has `tensorrt_llm` (the system python3 of NGC's
`tritonserver:24.10-trtllm-python-py3` image, TensorRT-LLM 0.14), not the project's venv.
`scripts/serve_trtllm.py` runs it when the engine is missing. Two steps:
1. `LLaMAForCausalLM.from_hugging_face(...).save_checkpoint(...)`: the checkpoint in TensorRT-LLM's layout;
2. `trtllm-build`: the engine, for in-flight batching (paged KV cache, packed inputs, paged context
   attention so long prompts can be prefilled in chunks).
Its limits come from the repository, so the engine and the models that use it agree:
`max_seq_len` = the front's `max_model_len`, `max_batch_size` = the `tensorrt_llm` model's.
Uses the standard library and tensorrt_llm only (no batchlm import: the venv's torch is not this one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRTLLM_REPOSITORY = ROOT / "docker" / "trtllm" / "model_repository"
PLAN_FILE = "batchlm_build.json"  # written into --out: what the engine was built from and with


def repository_limits(repository: Path = TRTLLM_REPOSITORY) -> dict[str, int]:
    """max_seq_len and max_batch_size as the shipped configs state them."""
    front = (repository / "continuous_batching_trtllm" / "config.pbtxt").read_text()
    engine = (repository / "tensorrt_llm" / "config.pbtxt").read_text()
    seq = re.search(r'key: "max_model_len" value: \{ string_value: "(\d+)" \}', front)
    batch = re.search(r"^max_batch_size: (\d+)", engine, re.M)
    if seq is None or batch is None:
        raise SystemExit("could not read max_model_len / max_batch_size from the trtllm model repository")
    return {"max_seq_len": int(seq.group(1)), "max_batch_size": int(batch.group(1))}


def checkpoint_digest(model_dir: Path) -> str | None:
    """sha256 over the checkpoint's config.json and weight files (names and contents), or None where
    there is no checkpoint: an engine built from other weights is not this one."""
    files = sorted(p for p in model_dir.glob("*") if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def build_command(checkpoint: Path, out: Path, limits: dict[str, int], max_num_tokens: int) -> list[str]:
    return ["trtllm-build", f"--checkpoint_dir={checkpoint}", f"--output_dir={out}",
            f"--max_batch_size={limits['max_batch_size']}", f"--max_seq_len={limits['max_seq_len']}",
            f"--max_input_len={limits['max_seq_len'] - 1}", f"--max_num_tokens={max_num_tokens}",
            "--gemm_plugin=auto", "--gpt_attention_plugin=auto", "--paged_kv_cache=enable",
            "--remove_input_padding=enable", "--use_paged_context_fmha=enable"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "default")
    ap.add_argument("--out", type=Path, default=ROOT / "engines" / "trtllm")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--max-num-tokens", type=int, default=2048, help="tokens in one engine step at most")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = ap.parse_args()

    model_dir, out = args.model_dir.resolve(), args.out.resolve()
    checkpoint = out.parent / (out.name + "-checkpoint")
    limits = repository_limits()
    command = build_command(checkpoint, out, limits, args.max_num_tokens)
    plan = {"model_dir": str(model_dir), "checkpoint_sha256": checkpoint_digest(model_dir), "dtype": args.dtype,
            "checkpoint_dir": str(checkpoint), "engine_dir": str(out), **limits,
            "max_num_tokens": args.max_num_tokens, "trtllm_build": command}
    if args.dry_run:
        print(json.dumps(plan, indent=2))
        return 0
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"no Hugging Face checkpoint at {model_dir} (run `make setup` for the default model)")
    try:
        import tensorrt_llm
        from tensorrt_llm.models import LLaMAForCausalLM
    except ImportError as exc:
        raise SystemExit(f"tensorrt_llm is not importable with {sys.executable} ({exc}): run this script with "
                         "the python3 of NGC's -trtllm-python-py3 image (a GPU machine)") from None

    print(f"[build_trtllm_engine] TensorRT-LLM {tensorrt_llm.__version__}: {model_dir} -> {checkpoint}", flush=True)
    LLaMAForCausalLM.from_hugging_face(str(model_dir), dtype=args.dtype).save_checkpoint(str(checkpoint),
                                                                                        save_config=True)
    print(f"[build_trtllm_engine] {shlex.join(command)}", flush=True)
    subprocess.run(command, check=True)
    (out / PLAN_FILE).write_text(json.dumps({**plan, "tensorrt_llm": tensorrt_llm.__version__}, indent=2) + "\n")
    print(f"[build_trtllm_engine] engine in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
