#!/usr/bin/env python
"""Stop tritonserver with gRPC requests parked in `static_batching`, many times, and say how each stop went.

    .venv/bin/python scripts/repro_sigterm_stall.py [--runs 20] [--park-s 2.0] [--drain]

Each run starts a server with only `static_batching` loaded (explicit model control, free ports), parks
3 gRPC requests (a batch needs 8), waits --park-s plus a random part of the watchdog's 0.5 s interval,
then SIGTERMs tritonserver (with --drain: unloads every model through the repository API first, as
`make serve` does on a signal). A stop is "clean" when the server exits 0 within 6 s and every client
got the model's UNAVAILABLE answer. Otherwise the line says how the instance's stub ended: a stub that
died is a zombie of tritonserver until it exits, and /proc gives its wait status (11: SIGSEGV).
The server logs stay in the run's folder (--work), named on each line that did not stop clean.

Session 27 (tritonserver 2.51, AMD EPYC, 2 cores): 7 of 156 SIGTERM stops hung (0 of 12 drained), each because the
stub died of SIGSEGV. With `faulthandler.enable(all_threads=True)` added at the top of the model's
`model.py` (by hand, not kept), the crashed stub's log showed the watchdog thread inside
`pb_utils.is_model_ready`, called after the SIGTERM (in the clean stops that call raises "Server not
ready"). A dead stub never
answers its parked requests, so Triton waits for them to the end of its exit timeout, exits 1, and the
clients see no answer until their deadline. The unload API raises no such race (see --drain).
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from batchlm.server.triton_server import TritonServer, free_port, process_tree
from client.triton_llm import LLMClient, RequestFailed

MODEL = "static_batching"
PARKED = 3


def _ask(server: TritonServer, i: int, timeout: float) -> str:
    client = LLMClient(server.http_url, server.grpc_url, timeout=timeout)
    try:
        client.infer_grpc(MODEL, f"Request number {i} asks", max_tokens=5, ignore_eos=True)
        return "answered"  # cannot happen: no batch is ever full
    except RequestFailed as exc:
        return "unloaded" if "unloaded before a full batch" in exc.message else f"{exc.status} {exc.message[:60]}"
    finally:
        client.close()


def _wait_status(pid: int) -> str:
    """'alive', 'gone', or the wait status of a zombie (the last field of /proc/<pid>/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    if fields[0] != "Z":
        return "alive"
    status = int(fields[-1])
    return f"killed by signal {status & 0x7f}" if status & 0x7f else f"exited {status >> 8}"


def one_stop(run: int, work: Path, park_s: float, drain: bool) -> bool:
    log = work / f"server-{run}.log"
    server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log,
                          extra_args=("--model-control-mode=explicit", f"--load-model={MODEL}"))
    server.start(timeout=300)
    try:
        stubs = process_tree(server.process.pid)
        with ThreadPoolExecutor(PARKED) as pool:
            asked = [pool.submit(_ask, server, i, 40.0) for i in range(PARKED)]
            time.sleep(park_s + random.uniform(0.0, 0.5))
            started = time.monotonic()
            if drain:
                server.drain(timeout=30)
            server.process.send_signal(signal.SIGTERM)
            try:
                server.process.wait(timeout=6)
            except subprocess.TimeoutExpired:
                pass
            stubs_then = {pid: _wait_status(pid) for pid in stubs}
            server.process.wait(timeout=120)
            took = time.monotonic() - started
            answers = [f.result() for f in asked]
        rc = server.process.returncode
        clean = rc == 0 and took < 6 and all(a == "unloaded" for a in answers)
        print(f"run {run}: {'clean' if clean else 'HUNG'} rc={rc} {took:.1f}s answers={answers} "
              f"stubs at 6 s: {stubs_then}" + ("" if clean else f" log: {log}"), flush=True)
        return clean
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--park-s", type=float, default=2.0, help="seconds between parking and the stop")
    parser.add_argument("--drain", action="store_true", help="unload through the repository API, then SIGTERM")
    parser.add_argument("--work", type=Path, default=None, help="folder for the server logs")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="sigterm-stall-"))
    work.mkdir(parents=True, exist_ok=True)
    clean = sum(one_stop(run, work, args.park_s, args.drain) for run in range(args.runs))
    print(f"{clean} of {args.runs} stops clean ({'drain, then SIGTERM' if args.drain else 'SIGTERM'}); logs in {work}")
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
