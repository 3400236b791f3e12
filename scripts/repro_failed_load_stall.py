#!/usr/bin/env python
"""Stop tritonserver after a load that failed, and after one that worked, and say how each stop went.

    .venv/bin/python scripts/repro_failed_load_stall.py [--model dynamic_batching] [--exit-timeout 15]

Each case starts a server with only --model loaded (explicit model control, free ports), asks the
repository API to load the model again, then SIGTERMs tritonserver and times its exit:
- "reloaded": the same config again (accepted, nothing changes);
- "refused": a config the model refuses at load (a batch larger than `max_num_seqs`: HTTP 400, naming
  the key); the version loaded before keeps serving.

A stop is "clean" when the server exits 0 without waiting out its exit timeout. Session 32
(tritonserver 2.51): every "reloaded" stop was clean (2.9 s) and every "refused" one was not: the loaded
version unloaded within 2 s, and the server then reported "Found 1 live models" once a second to the end
of its exit timeout and exited 1 ("Exit timeout expired"), the same with --model static_batching.
The failed load is still counted as live by the server's shutdown. `make serve` is not exposed to it:
its repository API is restricted to the script, which loads nothing after the start.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from batchlm.server.triton_server import TritonServer, free_port

ONCE = {"Connection": "close"}  # NOTE: a connection left open would hold the SIGTERM on its own


def _bad_config(model: str, config: dict) -> dict:
    if model == "dynamic_batching":
        config["max_batch_size"] = 16
    else:
        config["parameters"]["batch_size"]["string_value"] = "16"
    return config


def one_stop(model: str, case: str, work: Path, exit_timeout: int) -> bool:
    log = work / f"server-{case}.log"
    server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log,
                          extra_args=("--model-control-mode=explicit", f"--load-model={model}"),
                          exit_timeout_s=exit_timeout)
    server.start(timeout=300)
    try:
        base = f"http://{server.http_url}/v2"
        config = requests.get(f"{base}/models/{model}/config", headers=ONCE, timeout=30).json()
        if case == "refused":
            config = _bad_config(model, config)
        status = requests.post(f"{base}/repository/models/{model}/load", headers=ONCE, timeout=300,
                               json={"parameters": {"config": json.dumps(config)}}).status_code
        ready = requests.get(f"{base}/models/{model}/ready", headers=ONCE, timeout=30).status_code
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        try:
            rc = server.process.wait(timeout=exit_timeout + 30)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - started
        text = log.read_text(errors="replace")
        clean = rc == 0 and "Exit timeout expired" not in text
        live = [line.split('"')[1] for line in text.splitlines() if "live models" in line]
        print(f"{case}: load answered {status}, model ready {ready == 200}; stop {'clean' if clean else 'STALLED'} "
              f"rc={rc} in {took:.1f}s; last count: {live[-1] if live else '-'}; log: {log}", flush=True)
        return clean
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("dynamic_batching", "static_batching"), default="dynamic_batching")
    parser.add_argument("--exit-timeout", type=int, default=15, help="tritonserver's --exit-timeout-secs")
    parser.add_argument("--work", type=Path, default=None, help="folder for the server logs")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="failed-load-stall-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {case: one_stop(args.model, case, work, args.exit_timeout) for case in ("reloaded", "refused")}
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
