#!/usr/bin/env python
"""Load the TensorRT-LLM front (`continuous_batching_trtllm`) run after run on one server, until a run
fails or --runs have passed: the check for the front's stub crash (`batchlm/serving/bls_reaper.py`).

    python scripts/stress_trtllm_front.py [--runs 16] [--concurrency 32] [--num-requests 96] [--lock-file F]

The engine behind the front is the functional tests' stand-in (`tests/functional/trtllm_standin/`).
Each run is the seeded workload, closed loop at --concurrency, alternately not streamed and streamed.
After each run it prints the run's output tok/s and failures and which stubs are alive; it stops at the
first run with a failure or a dead stub, then prints any heap-corruption line the server logged.
Exits 1 if a run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchlm.triton_server import TritonServer, free_port  # noqa: E402
from client.arrivals import ArrivalSpec  # noqa: E402
from client.benchmark import BenchmarkConfig  # noqa: E402
from client.report import measure  # noqa: E402
from client.workload import WorkloadSpec, build_requests  # noqa: E402
from tests.functional.trtllm_standin import FRONT, standin_repository  # noqa: E402



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take")
    ap.add_argument("--out", type=Path, default=Path("results/stress_trtllm_front"))
    ap.add_argument("--lock-file", type=Path, help="hold this flock while the server runs")
    args = ap.parse_args()

    spec = WorkloadSpec(num_requests=args.num_requests)
    requests = build_requests(spec)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    log = args.out / "server.log"
    server = TritonServer(model_repository=standin_repository(args.out / "repository"), http_port=free_port(),
                          grpc_port=free_port(), metrics_port=free_port(), log_path=log)
    passed = 0
    with contextlib.ExitStack() as stack:
        if args.lock_file:
            lock = stack.enter_context(open(args.lock_file, "w"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        stack.enter_context(server)
        expected = sorted(server.stubs().values())
        for run in range(args.runs):
            stream = run % 2 == 1
            config = BenchmarkConfig(FRONT, server.http_url, server.grpc_url, server.metrics_url,
                                     ArrivalSpec.closed_loop(args.concurrency), stream=stream, timeout=args.timeout)
            start = time.monotonic()
            summary = measure(config, requests, spec.as_dict())["summary"]
            alive = sorted(server.stubs().values())
            print(f"run {run + 1}: stream={stream} {time.monotonic() - start:.1f}s "
                  f"{summary['output_token_throughput']:.1f} out tok/s, failures {summary['failures'] or 'none'}, "
                  f"stubs alive {alive}", flush=True)
            if summary["failures"] or alive != expected:
                break
            passed += 1
    heap = server.crash_lines()
    print(f"{passed} of {args.runs} runs passed; heap errors logged: {heap or 'none'}; log: {log}")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
