"""Resident memory of a served model repository, per process: `batchlm-bench memory`.

    batchlm-bench memory [--model-repository model_repository] [--model PATH] [--requests 8]

Starts tritonserver on the repository (free ports, every model loaded), waits until every model is
ready, sends each model `--requests` requests at once (64 tokens each, EOS ignored: every weight and some
KV blocks are touched, as in service; 0 sends none), then reads each process's resident set (VmRSS), its
peak (VmHWM) and its proportional set (Pss: pages shared with other processes, such as libraries and the
shared weights, split between them) from /proc; prints a markdown table and the seconds from start to
ready, and stops the server. `--model` serves another checkpoint in every model, as `batchlm-serve
--model` does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from batchlm.launcher.ports import free_port
from batchlm.launcher.triton_server import TritonServer
from batchlm.paths import DEFAULT_REPOSITORY, MODEL_ENV


def _kib(pid: int, key: str, name: str = "status") -> int:
    with open(f"/proc/{pid}/{name}") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(f"{key} not in /proc/{pid}/{name}")


def process_memory(pid: int) -> dict[str, float]:
    """MiB: rss, peak rss (hwm) and pss of one process."""
    return {"rss": _kib(pid, "VmRSS:") / 1024, "hwm": _kib(pid, "VmHWM:") / 1024,
            "pss": _kib(pid, "Pss:", "smaps_rollup") / 1024}


def exercise(url: str, models: list[str], requests: int) -> None:
    """`requests` concurrent generate requests to each model in turn (64 new tokens, EOS ignored)."""
    body = json.dumps({"text_input": "Tell me about the sea.", "max_tokens": 64, "ignore_eos": True}).encode()

    def one(model: str) -> None:
        req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.read()

    with ThreadPoolExecutor(max(requests, 1)) as pool:
        for model in models:
            list(pool.map(one, [model] * requests))


def measure(repository: Path, log: Path | None = None,
            requests: int = 8) -> tuple[float, dict[str, dict[str, float]]]:
    """(seconds from start to ready, process name -> process_memory) of a server on `repository`."""
    server = TritonServer(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), log_path=log)
    start = time.monotonic()
    server.start(timeout=600)
    try:
        ready = time.monotonic() - start
        stubs = sorted(server.stub_instances().items())
        exercise(server.http_url, sorted({model for _, (model, _) in stubs}), requests)
        rows = {f"{model} stub": process_memory(pid) for pid, (model, _) in stubs}
        rows["tritonserver"] = process_memory(server.process.pid)
    finally:
        server.stop()
    return ready, rows


def table(rows: dict[str, dict[str, float]]) -> str:
    lines = ["| process | resident (RSS) | peak RSS | proportional (PSS) |", "|---|---:|---:|---:|"]
    for name, m in [*rows.items(), ("total", {k: sum(r[k] for r in rows.values()) for k in ("rss", "hwm", "pss")})]:
        lines.append(f"| {name} | {m['rss']:.0f} MiB | {m['hwm']:.0f} MiB | {m['pss']:.0f} MiB |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    ap.add_argument("--model", type=Path, help="checkpoint every model serves instead of its model_dir")
    ap.add_argument("--log", type=Path, help="the server's log (default: none)")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests per model before reading")
    args = ap.parse_args()
    if args.model is not None:
        os.environ[MODEL_ENV] = str(args.model.resolve())
    ready, rows = measure(args.model_repository.resolve(), args.log, args.requests)
    print(f"every model ready {ready:.1f} s after the start")
    print(table(rows))
    return 0
