"""Start, probe and stop a real `tritonserver` process over a model repository.

Used by the serve command, the test fixtures and the benchmarks. It never leaves an orphan behind: the
server runs in its own process session, and `stop()` ends the server and every Python backend stub it
started, even when the server hangs on shutdown. Finding the install: triton_install.py; the key of the
administrative APIs: admin_key.py (and argv_secret.py, opt-in); reading its log: server_log.py.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from batchlm.api_key import API_KEY_ENV
from batchlm.backend.instance_claim import clear_claims
from batchlm.launcher import admin_key, argv_secret, server_log
from batchlm.launcher.admin_key import ADMIN_HEADER, RESTRICTED_APIS
from batchlm.launcher.deferred_signals import DeferredSignals
from batchlm.launcher.model_control import model_control_mode
from batchlm.launcher.ports import LOOPBACK
from batchlm.launcher.processes import die_with_parent, kill_group, process_tree, stub_instances
from batchlm.launcher.triton_install import TritonInstall
from batchlm.paths import DEFAULT_REPOSITORY


@dataclass
class TritonServer:
    """One tritonserver process. Use as a context manager, or call start()/stop()."""

    model_repository: Path = DEFAULT_REPOSITORY
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_path: Path | None = None
    # With no log_path: True sends the server's output to this process's stdout and stderr, False drops it.
    show_output: bool = False
    extra_args: tuple[str, ...] = ()
    # The address HTTP, gRPC and metrics bind: loopback unless the caller asks for another (0.0.0.0 is
    # every interface; Triton itself has no authentication, see docs/operations.md, "Security").
    address: str = LOOPBACK
    # The APIs that answer only requests carrying `admin_header` (over HTTP and gRPC): loading and
    # unloading models, shared-memory registration, log and trace settings. Empty: none restricted.
    restricted_apis: tuple[str, ...] = RESTRICTED_APIS
    install: TritonInstall | None = None
    # On SIGTERM: the most seconds tritonserver waits for requests in flight to end and models to unload
    # before it exits anyway (Triton's --exit-timeout-secs).
    exit_timeout_s: int = 15
    # True: keep admin_token off the server's command line, which every local user can read, with the
    # preloaded argv_secret library (built with the machine's C compiler on first use). False: the token
    # is an argument of tritonserver, as tritonserver takes it (docs/operations.md, "Security").
    hide_admin_key: bool = False
    process: subprocess.Popen | None = field(default=None, init=False)
    # Python backend shared-memory regions of this server are named with this prefix, so stop() can
    # remove the ones a killed stub leaves in /dev/shm.
    shm_prefix: str = field(default_factory=lambda: f"batchlm_{uuid.uuid4().hex[:12]}_", init=False)
    # The value of ADMIN_HEADER that the restricted APIs ask for: made at random for each server object.
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16), init=False, repr=False)
    # What stands for admin_token on the command line where the library is preloaded: random per server.
    token_placeholder: str = field(default_factory=argv_secret.new_placeholder, init=False, repr=False)
    _log_file: object = field(default=None, init=False, repr=False)
    _log_start: int = field(default=0, init=False, repr=False)  # where this start's lines begin in log_path

    @property
    def host(self) -> str:
        """Where this machine's clients reach the server: loopback where it binds every interface."""
        return LOOPBACK if self.address in ("0.0.0.0", LOOPBACK) else self.address

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def admin_header(self) -> tuple[str, str] | None:
        """The header (name, value) the restricted APIs ask for, or None where this object restricts none."""
        return (ADMIN_HEADER, self.admin_token) if self._restricts() else None

    @property
    def admin_headers(self) -> dict[str, str]:
        """`admin_header` as HTTP request headers (empty where nothing is restricted)."""
        return dict([self.admin_header]) if self.admin_header else {}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """`admin_header` as gRPC metadata: tritonserver asks for the name behind `triton-grpc-protocol-`."""
        return {f"triton-grpc-protocol-{name}": value for name, value in self.admin_headers.items()}

    def _restricts(self) -> bool:
        return admin_key.restricts(self.restricted_apis, self.extra_args)

    @property
    def token_hidden(self) -> bool:
        """Whether admin_token stays off the server's command line (argv_secret: its placeholder is
        there, the token reaches tritonserver through its environment); False unless `hide_admin_key`
        asks for it, where nothing is restricted, or where the library cannot be built."""
        return self.hide_admin_key and self._restricts() and self._secret_preload is not None

    @functools.cached_property
    def _secret_preload(self) -> Path | None:
        """The library that keeps admin_token off the command line (argv_secret), looked up (and built)
        once; None where it cannot be built or used."""
        return argv_secret.library()

    def restriction_args(self) -> list[str]:
        """tritonserver arguments that restrict `restricted_apis` to requests with `admin_header`."""
        if not self._restricts():
            return []
        return admin_key.restriction_args(self.restricted_apis,
                                          self.token_placeholder if self.token_hidden else self.admin_token)

    @property
    def drainable(self) -> bool:
        """Whether drain() can unload this server's models: its arguments choose explicit model control."""
        return model_control_mode(self.extra_args) == "explicit"

    def command(self) -> list[str]:
        """The server's command line."""
        install = self.install or TritonInstall.find()
        return [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-address={self.address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.address}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.address}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            *self.restriction_args(),
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        """The server's environment: the stub must run this interpreter's environment (venv)."""
        env = (self.install or TritonInstall.find()).environment()
        env.pop(API_KEY_ENV, None)  # the frontend's key: no model needs it, so no stub should hold it
        if self.token_hidden:
            env = argv_secret.environment(env, self.admin_token, self.token_placeholder, self._secret_preload)
        return env

    def start(self, timeout: float = 180.0) -> "TritonServer":
        """Start the server and wait until it reports ready; raise with the log tail if it does not."""
        out = None if self.show_output else subprocess.DEVNULL
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")
            self._log_start = self._log_file.tell()
            out = self._log_file
        with DeferredSignals():  # NOTE: a stop signal waits until the handle is kept, for stop() to use
            self.process = subprocess.Popen(
                self.command(), env=self.environment(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        try:
            if self.token_hidden:
                admin_key.await_taken(self.process, self.admin_token, self._secret_preload)
            elif self.hide_admin_key and self._restricts():
                admin_key.warn_key_shown()
            self.wait_ready(timeout)
            if self.token_hidden:
                admin_key.check_taken(self.http_url, self.restricted_apis, self.admin_headers)
        except BaseException:  # NOTE: SystemExit from exit_cleanly_on_sigterm too
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        """HTTP reports ready, and the metrics endpoint answers: tritonserver starts its metrics service
        after HTTP and gRPC, and a caller that read metrics within those milliseconds was refused."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout: float) -> None:
        """Wait until is_ready(); RuntimeError if the server exits first, TimeoutError after `timeout` s
        (both with the log's tail)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}"
                                   f"{server_log.log_tail(self.log_path)}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s{server_log.log_tail(self.log_path)}")

    def load_failures(self) -> list[str]:
        """Why models did not load, in tritonserver's words, from this start's part of the log."""
        return server_log.load_failures(self.log_path, self._log_start)

    def crash_lines(self) -> list[str]:
        """Lines of the server's log that show a process crashing (heap corruption, a fatal signal)."""
        return server_log.crash_lines(self.log_path)

    def descendants(self) -> list[int]:
        """PIDs of the server's process tree (stubs included), read from /proc."""
        return [] if self.process is None else process_tree(self.process.pid)

    def stubs(self) -> dict[int, str]:
        """Live Python backend stubs of this server: pid -> the model each serves."""
        return {pid: model for pid, (model, _) in self.stub_instances().items()}

    def stub_instances(self) -> dict[int, tuple[str, str]]:
        """Live Python backend stubs of this server: pid -> (model, model instance) each serves."""
        return stub_instances(self.descendants())

    def drain(self, timeout: float = 60.0) -> list[str]:
        """Unload every loaded model and wait until none is left; return the ones unloaded.

        Needs explicit model control (`--model-control-mode=explicit`; tritonserver refuses an unload
        otherwise). Parked and waiting requests are answered UNAVAILABLE, running ones finish. Call it
        before stop() when HTTP clients may have requests parked in static_batching: on SIGTERM
        tritonserver first waits, up to its exit timeout, for every open HTTP connection to close, and a
        parked request's connection stays open, even after its client has died, until the model answers
        it, which it does only at unload; so the server waits out its exit timeout and exits without
        unloading anything."""
        base = f"http://{self.http_url}/v2/repository"

        headers = self.admin_headers

        def post(path: str) -> bytes:
            request = urllib.request.Request(f"{base}/{path}", data=b"{}", method="POST", headers=headers)
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.read()

        def loaded() -> list[str]:
            return [m["name"] for m in json.loads(post("index"))
                    if m.get("state") in ("READY", "LOADING", "UNLOADING")]

        names = loaded()
        for name in names:
            post(f"models/{name}/unload")
        deadline = time.monotonic() + timeout
        while (left := loaded()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            raise TimeoutError(f"models still loaded {timeout:.0f} s after their unload: {left}")
        return names

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM the server (it unloads models, which stops their threads), then kill what is left:
        after `grace` seconds, by default its exit timeout and 5 s more. tritonserver does not always
        end by itself after its exit timeout: where a stub died holding gRPC requests it goes on waiting
        for those calls, so the stop never depends on it."""
        with DeferredSignals():  # NOTE: a signal must not cut it short: it removes the stubs
            self._stop(self.exit_timeout_s + 5.0 if grace is None else grace)

    def _stop(self, grace: float) -> None:
        if self.process is None:
            return
        stubs = self.descendants()
        # NOTE: Triton's SIGTERM handling first waits, up to its exit timeout, for every open HTTP
        # connection to close, then unloads the models in whatever time is left. A client socket of this
        # process kept alive only by a reference cycle (a failed request's traceback holds its response)
        # made it wait out its exit timeout and exit without unloading any model; collect such cycles first.
        gc.collect()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        kill_group(self.process.pid)
        for pid in stubs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for region in Path("/dev/shm").glob(self.shm_prefix + "*"):
            region.unlink(missing_ok=True)
        clear_claims(self.process.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self.process = None

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
