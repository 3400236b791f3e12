"""Check the shutdown right after Locust runs against every model: SIGTERM, then what was unloaded.

    python scripts/shutdown_after_load.py [--tries 3]

Each try starts a server with the project's repository, runs the gRPC streaming locustfile headless
against each model at once (8 users, 20 s, outputs of mean 32 tokens), then stops the server with
SIGTERM and prints its exit code and the models it unloaded. Exit code 1 and missing models mean
Triton waited out its 15 s exit timeout (README, "Errors, overload and shutdown"). Up to session 20 it
did, every try: the gRPC user cancelled each stream after its request had ended, which left Triton
holding the model; since the user cancels only a request still running, 3 of 3 tries exited at once.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from batchlm.paths import PROJECT_ROOT as ROOT
from batchlm.server.triton_server import TritonServer, exit_cleanly_on_sigterm, free_port

MODELS = ("static_batching", "dynamic_batching", "continuous_batching")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=3)
    args = p.parse_args()
    exit_cleanly_on_sigterm()
    locust = str(Path(sys.executable).parent / "locust")
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(args.tries):
            log = Path(tmp) / f"server{attempt}.log"
            server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                  log_path=log)
            server.start(timeout=300)
            try:
                users = [subprocess.Popen([locust, "-f", str(ROOT / "locustfiles" / "grpc_stream_user.py"),
                                           "--headless", "--host", server.grpc_url, "--model", model,
                                           "-u", "8", "-r", "8", "-t", "20s", "--output-mean", "32"],
                                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                         for model in MODELS]
                for user in users:
                    user.wait()
            finally:
                process = server.process
                server.stop()
            unloaded = re.findall(r"successfully unloaded .([a-z_]*).", log.read_text())
            print(f"try {attempt}: exit code {process.returncode}, unloaded {unloaded}", flush=True)


if __name__ == "__main__":
    main()
