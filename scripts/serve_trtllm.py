#!/usr/bin/env python
"""Serve all five models on a GPU: the three strategies on batchlm's engine and TensorRT-LLM's in-flight
batching, side by side, on one tritonserver (NGC's `tritonserver:<TRITON_RELEASE>-trtllm-python-py3` image,
docker/versions.env).

    .venv/bin/python scripts/serve_trtllm.py [--device cuda] [--engine-dir engines/trtllm] [--rebuild]
                                             [--model-dir M] [--dtype D] [--max-num-tokens N]
                                             [--tp-size T] [--pp-size P]           # for the build
    .venv/bin/python scripts/serve_trtllm.py --prepare-only --out DIR   # write the repository and exit

1. Builds the engine if `--engine-dir` holds none, or one built to another plan (limits, checkpoint,
   dtype, parallel sizes, GPU architecture) or TensorRT-LLM version (`scripts/build_trtllm_engine.py`, run
   with `--trtllm-python`, the interpreter that has tensorrt_llm).
2. Writes a model repository under `--out` (never into the tracked folders): `model_repository/`'s three
   models with `device` set to `--device`, and `docker/trtllm/model_repository/`'s two with the engine's
   folder filled into `tensorrt_llm`'s `gpt_model_path`. An engine of tp_size x pp_size > 1 ranks gets
   GPUs 0 .. ranks-1 (`gpu_device_ids`) and TensorRT-LLM's orchestrator mode (TRTLLM_ORCHESTRATOR=1),
   which starts one worker process per rank under this one tritonserver.
3. Serves it as scripts/serve.py does (explicit model control, every model loaded; a signal drains the
   server, then stops it). Ports as for scripts/serve.py.
Clients send the same requests to `continuous_batching_trtllm` as to `continuous_batching`; the serving
benchmark measures either (`batchlm/bench/served/run.py continuous_batching_trtllm --concurrency 32`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from batchlm.launcher.model_control import with_model_control
from batchlm.launcher.ports import LOOPBACK
from batchlm.launcher.serve_loop import serve_until_signalled
from batchlm.launcher.triton_server import TritonServer
from batchlm.paths import DEFAULT_REPOSITORY, PROJECT_ROOT

TRTLLM_REPOSITORY = PROJECT_ROOT / "docker" / "trtllm" / "model_repository"
STRATEGIES = ("static_batching", "dynamic_batching", "continuous_batching")
ENGINE_FILES = ("config.json", "rank0.engine")
PLAN_FILE = "batchlm_build.json"  # what build_trtllm_engine.py built the engine from and with


GPU_IDS_LINE = 'parameters { key: "gpu_device_ids" value: { string_value: "0" } }'


def prepare_repository(out: Path, engine_dir: Path, device: str, ranks: int = 1) -> Path:
    """Write the five models into `out` (replacing what was there); returns `out`. `ranks`: the engine's
    tp_size x pp_size, one GPU each."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__")
    for name in STRATEGIES:
        shutil.copytree(DEFAULT_REPOSITORY / name, out / name, ignore=ignore)
        config = out / name / "config.pbtxt"
        text = config.read_text()
        if 'key: "device"' in text:
            raise SystemExit(f"{name}/config.pbtxt already sets device; edit it there instead")
        config.write_text(text + f'# Written by scripts/serve_trtllm.py --device.\n'
                                 f'parameters {{ key: "device" value: {{ string_value: "{device}" }} }}\n')
    for name in ("continuous_batching_trtllm", "tensorrt_llm"):
        shutil.copytree(TRTLLM_REPOSITORY / name, out / name, ignore=ignore)
    engine_config = out / "tensorrt_llm" / "config.pbtxt"
    text = engine_config.read_text().replace("${engine_dir}", str(engine_dir.resolve()))
    if GPU_IDS_LINE not in text:
        raise SystemExit(f"tensorrt_llm/config.pbtxt no longer has the line {GPU_IDS_LINE!r}")
    gpus = ",".join(str(i) for i in range(ranks))
    engine_config.write_text(text.replace(GPU_IDS_LINE, GPU_IDS_LINE.replace('"0"', f'"{gpus}"')))
    return out


# where the build plan names folders: not compared, so a checkout moved or mounted elsewhere keeps its engine
PATH_KEYS = ("model_dir", "checkpoint_dir", "engine_dir")
PATH_FLAGS = ("--model_dir=", "--checkpoint_dir=", "--output_dir=")
COMMAND_KEYS = ("convert", "trtllm_build")


def _portable(plan: dict) -> dict:
    """The plan without its folders: what the engine itself depends on."""
    kept = {key: value for key, value in plan.items() if key not in PATH_KEYS}
    for key in COMMAND_KEYS:
        if key in kept:
            kept[key] = [a for a in kept[key] if not a.startswith(PATH_FLAGS)]
    return kept


def why_build(engine_dir: Path, plan: dict, trtllm_version: str | None) -> str | None:
    """Why the engine in `engine_dir` must be built (again), or None where it was built to `plan` (what
    `build_trtllm_engine.py --dry-run` prints now: limits from the shipped configs, the checkpoint's
    digest, dtype, parallel sizes, both steps' flags, the GPUs' compute capability; folders are not
    compared) with `trtllm_version` (None: not known, not compared). Were any engine found served,
    after a change of `max_model_len` or `max_batch_size` the front would admit prompts the engine
    refuses, after new weights the engine would serve the old ones, and after a TensorRT-LLM upgrade
    the old engine would fail to load."""
    missing = [f for f in (*ENGINE_FILES, PLAN_FILE) if not (engine_dir / f).is_file()]
    if missing:
        return f"{engine_dir} has no {', '.join(missing)}"
    try:
        built = json.loads((engine_dir / PLAN_FILE).read_text())
    except ValueError as exc:
        return f"{engine_dir / PLAN_FILE} is unreadable ({exc})"
    built, plan = _portable(built), _portable(plan)
    changed = sorted(key for key, value in plan.items() if built.get(key) != value)
    if changed:
        return "built with other " + ", ".join(f"{key} ({built.get(key)!r}, now {plan[key]!r})" for key in changed)
    if trtllm_version is not None and built.get("tensorrt_llm") != trtllm_version:
        return f"built with TensorRT-LLM {built.get('tensorrt_llm')}, {trtllm_version} installed"
    return None


def installed_trtllm(python: str) -> str | None:
    """The version of tensorrt_llm that `python` has (read without importing it), or None."""
    probe = "import importlib.metadata as m; print(m.version('tensorrt_llm'))"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def ensure_engine(engine_dir: Path, python: str, rebuild: bool, build_args: list[str]) -> None:
    """Build the engine with `build_args` (build_trtllm_engine.py's own options) unless `engine_dir`
    holds one built to the plan they make now (`why_build`)."""
    script = PROJECT_ROOT / "scripts" / "build_trtllm_engine.py"
    command = [str(script), "--out", str(engine_dir), *build_args]
    if not rebuild:
        dry = subprocess.run([sys.executable, *command, "--dry-run"], capture_output=True, text=True)
        if dry.returncode != 0:
            raise SystemExit(f"[serve_trtllm] the engine's build plan failed: {dry.stderr.strip()}")
        reason = why_build(engine_dir, json.loads(dry.stdout), installed_trtllm(python))
        if reason is None:
            return
        print(f"[serve_trtllm] building the engine: {reason}", flush=True)
    subprocess.run([python, *command], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="where the three batchlm strategies run (TensorRT-LLM always runs on the GPU)")
    ap.add_argument("--engine-dir", type=Path, default=PROJECT_ROOT / "engines" / "trtllm")
    ap.add_argument("--trtllm-python", default=os.environ.get("TRTLLM_PYTHON", "/usr/bin/python3"))
    ap.add_argument("--rebuild", action="store_true", help="build the engine even if one exists")
    ap.add_argument("--model-dir",
                    help="the engine's checkpoint (build_trtllm_engine.py's default: models/SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", help="the engine's dtype (build_trtllm_engine.py's default: float16)")
    ap.add_argument("--max-num-tokens", type=int, help="tokens in one engine step at most (default 2048)")
    ap.add_argument("--tp-size", type=int, default=1, help="the engine's tensor-parallel size (GPUs per layer)")
    ap.add_argument("--pp-size", type=int, default=1, help="the engine's pipeline-parallel size (GPUs per model)")
    ap.add_argument("--out", type=Path, default=PROJECT_ROOT / ".cache" / "trtllm_repository")
    ap.add_argument("--prepare-only", action="store_true", help="write the repository, do not build or serve")
    ap.add_argument("--address", default=LOOPBACK,
                    help="the address HTTP, gRPC and metrics bind (default 127.0.0.1; a container publishing "
                         "its ports needs 0.0.0.0: see docs/operations.md, Security)")
    ap.add_argument("--hide-admin-key", action="store_true",
                    help="keep the administrative APIs' key off tritonserver's command line (docs/operations.md)")
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    args = ap.parse_args()

    ranks = args.tp_size * args.pp_size
    repository = prepare_repository(args.out, args.engine_dir, args.device, ranks)
    if args.prepare_only:
        print(repository)
        return 0
    build_args = [f"--{name.replace('_', '-')}={value}" for name, value in
                  (("model_dir", args.model_dir), ("dtype", args.dtype), ("max_num_tokens", args.max_num_tokens),
                   ("tp_size", args.tp_size), ("pp_size", args.pp_size))
                  if value is not None]
    ensure_engine(args.engine_dir, args.trtllm_python, args.rebuild, build_args)
    if ranks > 1:
        os.environ["TRTLLM_ORCHESTRATOR"] = "1"  # read by TensorRT-LLM's backend in this server's process
    server = TritonServer(model_repository=repository, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, show_output=True,
                          extra_args=tuple(with_model_control([])), address=args.address,
                          hide_admin_key=args.hide_admin_key)
    return serve_until_signalled(server)


if __name__ == "__main__":
    sys.exit(main())
