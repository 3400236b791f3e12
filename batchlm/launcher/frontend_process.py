"""The frontend as a child process, and the server that `batchlm-serve` runs with it: the frontend
starts once Triton is ready, and stops first.

Imports nothing of the web stack: the frontend runs in its own interpreter (`python -m batchlm.frontend`).
Its API key reaches it in its environment ($BATCHLM_API_KEY), never on its command line: /proc/<pid>/cmdline
is readable by every local user, /proc/<pid>/environ by the process's own user only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from batchlm.api_key import API_KEY_ENV
from batchlm.launcher.processes import die_with_parent
from batchlm.launcher.triton_server import TritonServer


@dataclass
class FrontendProcess:
    """One `python -m batchlm.frontend` process in front of the Triton at `triton_grpc`."""

    triton_grpc: str
    host: str = "127.0.0.1"
    port: int = 9000
    graceful_timeout: float = 10.0  # seconds a stop lets the answers in flight finish
    log_path: Path | None = None    # its log; None: this process's terminal
    api_key: str | None = field(default=None, repr=False)  # the bearer token it asks for; None: none
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "batchlm.frontend", "--triton-grpc", self.triton_grpc,
                "--host", self.host, "--port", str(self.port), "--graceful-timeout", str(self.graceful_timeout)]

    def environment(self) -> dict[str, str]:
        """This process's environment with $BATCHLM_API_KEY set to `api_key`, or removed where it is None:
        the frontend asks for this object's key, not for whatever the caller's environment holds."""
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        return env

    def start(self, timeout: float = 60.0) -> "FrontendProcess":
        """Start it and wait until `/health` answers 200; RuntimeError (and nothing left running) if
        it exits or does not answer within `timeout` s."""
        # NOTE: a session of its own, as the server's: a terminal's Ctrl-C reaches the serve command
        # only, which stops the frontend itself, first
        if self.log_path is None:
            self.process = subprocess.Popen(self.command(), env=self.environment(), start_new_session=True,
                                            preexec_fn=die_with_parent)
        else:
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True,
                                                preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise RuntimeError(f"the OpenAI frontend exited with status {code} (its log says why)")
            if self._healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the OpenAI frontend did not answer on {self.url}/health within {timeout:.0f} s")

    def _healthy(self) -> bool:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        try:
            with urllib.request.urlopen(f"http://{host}:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM (uvicorn stops accepting and lets the answers in flight finish), then SIGKILL after
        the graceful timeout and 5 s more. Idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.graceful_timeout + 5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process = None


@dataclass
class ServerWithFrontend(TritonServer):
    """A TritonServer whose start also starts `frontend` (pointed at this server's gRPC endpoint) once
    the server is ready, and whose drain and stop stop the frontend first. No frontend: a TritonServer."""

    frontend: FrontendProcess | None = None

    def start(self, timeout: float = 180.0) -> "ServerWithFrontend":
        super().start(timeout)
        if self.frontend is not None:
            self.frontend.triton_grpc = self.grpc_url
            self.frontend.start()
            print(f"OpenAI frontend ready: {self.frontend.url}/v1", flush=True)
        return self

    def drain(self, timeout: float = 60.0) -> list[str]:
        if self.frontend is not None:
            self.frontend.stop()
        return super().drain(timeout)

    def stop(self, grace: float | None = None) -> None:
        if self.frontend is not None:
            self.frontend.stop()
        super().stop(grace)
