#!/usr/bin/env python
"""Serve the model repository with a real tritonserver until interrupted.

    python scripts/serve.py [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]

Ports also come from HTTP_PORT, GRPC_PORT, METRICS_PORT. `make serve` runs the set-up first.

Without `--log` this process becomes tritonserver (its log on the terminal; it handles SIGINT and SIGTERM
itself). With `--log` it starts the server and waits: SIGINT, SIGTERM or SIGHUP stop the server, which
unloads its models, and then this script removes what the server's stubs left (shared-memory regions,
instance claims) and exits 0.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchlm.triton_server import DEFAULT_REPOSITORY, TritonServer, exit_cleanly_on_sigterm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    ap.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    ap.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    ap.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    ap.add_argument("--log", type=Path, default=None, help="write the server log here (default: terminal)")
    ap.add_argument("extra", nargs="*", help="extra tritonserver arguments, after --")
    args = ap.parse_args()

    server = TritonServer(
        model_repository=args.model_repository.resolve(), http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, log_path=args.log,
        extra_args=tuple(args.extra),
    )
    if args.log is None:
        # Foreground: the server's own log goes to this terminal.
        os.execve(server.command()[0], server.command(), server.environment())
    exit_cleanly_on_sigterm()  # NOTE: SIGTERM's default action would end this process before server.stop()
    # NOTE: the signals this script stops on must reach it even when its parent handed it SIGINT ignored
    # (a job started in the background by a shell without job control) or blocked.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        server.start()
        print(f"tritonserver ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}",
              flush=True)
        # NOTE: not signal.pause(): a signal that lands after Python's last check for pending signals and
        # before pause() is entered leaves pause() waiting for the next one, and the server running. (A
        # candidate cause, not reproduced, of a clean `make test` in which a SIGINT sent right after the
        # ready line stopped nothing.) A pending signal's handler runs at the latest when this sleep ends.
        while True:
            time.sleep(0.5)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the stop short
            signal.signal(signum, signal.SIG_IGN)
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
