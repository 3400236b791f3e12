#!/usr/bin/env python3
"""Build the TensorRT-LLM engine that the `tensorrt_llm` model serves, from a Hugging Face Llama checkpoint.

    python3 scripts/build_trtllm_engine.py [--model-dir models/SmolLM2-135M-Instruct] [--out engines/trtllm]
                                           [--dtype float16] [--tp-size 1] [--pp-size 1] [--max-num-tokens 2048]
    python3 scripts/build_trtllm_engine.py --dry-run      # print the plan; needs no TensorRT-LLM and no GPU

GPU only: run it with the interpreter that has `tensorrt_llm` (the system python3 of NGC's
`tritonserver:<TRITON_RELEASE>-trtllm-python-py3` image, docker/versions.env), not the project's venv.
`scripts/serve_trtllm.py` runs it when the engine is missing or was built to another plan. Two processes,
as TensorRT-LLM documents its engine flow:
1. the checkpoint conversion: this script's `convert` mode, which takes the flags of TensorRT-LLM's
   examples/models/core/llama/convert_checkpoint.py (`--model_dir --output_dir --dtype --tp_size --pp_size`)
   and does what that script does for a plain Hugging Face checkpoint (`LLaMAForCausalLM.from_hugging_face`
   per rank, then `save_checkpoint`); the examples folder is not part of the image;
2. `trtllm-build`: the engine, for in-flight batching: paged KV cache (`--kv_cache_type paged`), packed
   inputs, and paged context attention, so long prompts are prefilled in chunks (`enable_chunked_context`).
Its limits come from the repository, so the engine and the models that use it agree:
`max_seq_len` = the front's `max_model_len`, `max_batch_size` = the `tensorrt_llm` model's.
The plan (`--dry-run`, and batchlm_build.json beside the engine) is the engine's cache key: the limits, the
checkpoint's digest, the dtype, the parallel sizes, both commands' flags and the GPUs' compute capability
(nvidia-smi); the TensorRT-LLM version is written beside it after the build.
Uses the standard library and tensorrt_llm only (no batchlm import: the venv's torch need not be this one).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRTLLM_REPOSITORY = ROOT / "docker" / "trtllm" / "model_repository"
VERSIONS = ROOT / "docker" / "versions.env"
PLAN_FILE = "batchlm_build.json"  # written into --out: what the engine was built from and with
TOKENS_PER_BLOCK = 32  # tokens in one KV-cache block; chunked prefill works in whole blocks


def read_versions(path: Path = VERSIONS) -> dict[str, str]:
    """docker/versions.env as a dict (KEY=VALUE lines; # comments)."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def repository_limits(repository: Path = TRTLLM_REPOSITORY) -> dict[str, int]:
    """max_seq_len and max_batch_size as the shipped configs state them."""
    front = (repository / "continuous_batching_trtllm" / "config.pbtxt").read_text()
    engine = (repository / "tensorrt_llm" / "config.pbtxt").read_text()
    seq = re.search(r'key: "max_model_len" value: \{ string_value: "(\d+)" \}', front)
    batch = re.search(r"^max_batch_size: (\d+)", engine, re.MULTILINE)
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


def gpu_compute_capability() -> list[str] | None:
    """The compute capabilities of this machine's GPUs (nvidia-smi; "9.0" for H100 and H200), or None
    where nvidia-smi is missing or fails. An engine runs only on the architecture it was built for."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], check=False,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps = sorted({line.strip() for line in done.stdout.splitlines() if line.strip()})
    return caps if done.returncode == 0 and caps else None


def check_limits(max_num_tokens: int, tokens_per_block: int, tp_size: int, pp_size: int) -> None:
    """Refuse, naming the flag, a plan the engine build or the executor would refuse later."""
    if tokens_per_block <= 0 or tokens_per_block & (tokens_per_block - 1):
        raise SystemExit(f"--tokens-per-block must be a power of two, got {tokens_per_block}")
    if max_num_tokens < tokens_per_block or max_num_tokens % tokens_per_block:
        raise SystemExit(f"--max-num-tokens must be a multiple of --tokens-per-block ({tokens_per_block}): chunked "
                         f"prefill fills whole KV blocks; got {max_num_tokens}")
    for flag, size in (("--tp-size", tp_size), ("--pp-size", pp_size)):
        if size < 1:
            raise SystemExit(f"{flag} must be at least 1, got {size}")


def convert_args(model_dir: Path, checkpoint: Path, dtype: str, tp_size: int, pp_size: int) -> list[str]:
    """Step 1's flags: convert_checkpoint.py's names (docker/trtllm/build_flags.txt lists the pinned ones)."""
    return [f"--model_dir={model_dir}", f"--output_dir={checkpoint}", f"--dtype={dtype}",
            f"--tp_size={tp_size}", f"--pp_size={pp_size}"]


def build_command(checkpoint: Path, out: Path, limits: dict[str, int], max_num_tokens: int,
                  tokens_per_block: int = TOKENS_PER_BLOCK) -> list[str]:
    """Step 2: trtllm-build for in-flight batching with chunked prefill; it builds one engine per rank of
    the checkpoint (tp_size x pp_size), one after another."""
    return ["trtllm-build", f"--checkpoint_dir={checkpoint}", f"--output_dir={out}",
            f"--max_batch_size={limits['max_batch_size']}", f"--max_seq_len={limits['max_seq_len']}",
            f"--max_input_len={limits['max_seq_len'] - 1}", f"--max_num_tokens={max_num_tokens}",
            "--gemm_plugin=auto", "--gpt_attention_plugin=auto", "--kv_cache_type=paged",
            f"--tokens_per_block={tokens_per_block}", "--remove_input_padding=enable", "--context_fmha=enable",
            "--use_paged_context_fmha=enable"]


def convert(argv: list[str]) -> int:
    """Step 1, in its own process: a Hugging Face Llama checkpoint -> TensorRT-LLM's checkpoint, one
    rank per tensor/pipeline-parallel shard."""
    ap = argparse.ArgumentParser(prog="build_trtllm_engine.py convert")
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--tp_size", type=int, default=1)
    ap.add_argument("--pp_size", type=int, default=1)
    args = ap.parse_args(argv)
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import LLaMAForCausalLM

    world_size = args.tp_size * args.pp_size
    for rank in range(world_size):
        mapping = Mapping(world_size=world_size, rank=rank, tp_size=args.tp_size, pp_size=args.pp_size)
        model = LLaMAForCausalLM.from_hugging_face(args.model_dir, args.dtype, mapping=mapping)
        model.save_checkpoint(args.output_dir, save_config=(rank == 0))
        del model
    return 0


def main() -> int:
    if sys.argv[1:2] == ["convert"]:
        return convert(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--out", type=Path, default=ROOT / "engines" / "trtllm")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size: GPUs that share each layer")
    ap.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel size: GPUs that split the layers")
    ap.add_argument("--max-num-tokens", type=int, default=2048,
                    help="tokens in one engine step at most (a multiple of --tokens-per-block)")
    ap.add_argument("--tokens-per-block", type=int, default=TOKENS_PER_BLOCK, help="tokens in one KV-cache block")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = ap.parse_args()
    check_limits(args.max_num_tokens, args.tokens_per_block, args.tp_size, args.pp_size)

    model_dir, out = args.model_dir.resolve(), args.out.resolve()
    checkpoint = out.parent / (out.name + "-checkpoint")
    limits = repository_limits()
    plan = {"model_dir": str(model_dir), "checkpoint_sha256": checkpoint_digest(model_dir), "dtype": args.dtype,
            "checkpoint_dir": str(checkpoint), "engine_dir": str(out), **limits,
            "max_num_tokens": args.max_num_tokens, "tokens_per_block": args.tokens_per_block,
            "tp_size": args.tp_size, "pp_size": args.pp_size, "gpu_compute_capability": gpu_compute_capability(),
            "convert": convert_args(model_dir, checkpoint, args.dtype, args.tp_size, args.pp_size),
            "trtllm_build": build_command(checkpoint, out, limits, args.max_num_tokens, args.tokens_per_block)}
    if args.dry_run:
        print(json.dumps(plan, indent=2))
        return 0
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"no Hugging Face checkpoint at {model_dir} (the default model's: `.venv/bin/python "
                         "scripts/install_default_model.py --hf-export models/SmolLM2-135M-Instruct`)")
    try:  # NOTE: read, not imported: this process holds no GPU memory while the steps run
        version = importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"tensorrt_llm is not installed for {sys.executable}: run this script with the python3 "
                         "of NGC's -trtllm-python-py3 image (a GPU machine)") from None
    pinned = read_versions().get("TENSORRT_LLM_VERSION")
    if pinned and version != pinned:
        print(f"[build_trtllm_engine] WARNING: TensorRT-LLM {version} here, docker/versions.env pins {pinned}, "
              f"whose backend the configs follow", flush=True)

    convert_command = [sys.executable, str(Path(__file__).resolve()), "convert", *plan["convert"]]
    for step, command in (("convert", convert_command), ("build", plan["trtllm_build"])):
        print(f"[build_trtllm_engine] {step}: {shlex.join(command)}", flush=True)
        subprocess.run(command, check=True)
    (out / PLAN_FILE).write_text(json.dumps({**plan, "tensorrt_llm": version}, indent=2) + "\n")
    print(f"[build_trtllm_engine] TensorRT-LLM {version}: engine in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
