"""Start, probe and stop a real `tritonserver` process over a model repository.

Used by the serve command, the test fixtures and the benchmarks. It never leaves an orphan behind: the
server runs in its own process session, and `stop()` ends the server and every Python backend stub it
started, even when the server hangs on shutdown.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from batchlm.paths import DEFAULT_REPOSITORY, PROJECT_ROOT
from batchlm.launcher import argv_secret
from batchlm.launcher.deferred_signals import STOP_SIGNALS, DeferredSignals
from batchlm.launcher.supervisor import ModelSupervisor
from batchlm.backend.instance_claim import clear_claims

_CRASH = re.compile(r"corrupt|double free|malloc|free\(\)|Segmentation|Aborted")
# NOTE: tritonserver 2.51's words for a model it would not load: a config it refused while reading the
# repository ("Poll failed for model directory 'm': ...") or a load that failed ("failed to load 'm' version 1: ...")
_LOAD_FAILURE = re.compile(r"\] \"(Poll failed for model directory '[^']*': .*|failed to load '[^']*' version .*)\"$")


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary and its backends live."""

    binary: Path
    backend_dir: Path
    lib_dir: Path | None = None  # extra LD_LIBRARY_PATH entry (the extracted wheel's libraries)

    @classmethod
    def find(cls) -> "TritonInstall":
        """$TRITON_HOME, then a `tritonserver` on PATH (NGC), then the project's extracted `.triton/`: the
        order `scripts/setup.sh` looks in. (With `.triton/` before PATH, a checkout set up outside an NGC
        container would serve that extracted 2.51 inside it.)"""
        home = os.environ.get("TRITON_HOME")
        on_path = shutil.which("tritonserver")
        if not home and on_path and (NGC_BACKENDS / "python").is_dir():  # NOTE: as setup.sh checks
            return cls(Path(on_path), NGC_BACKENDS)
        base = Path(home) if home else PROJECT_ROOT / ".triton"
        if (base / "bin" / "tritonserver").exists():
            lib = base / "lib"
            return cls(base / "bin" / "tritonserver", base / "backends", lib if lib.is_dir() else None)
        if home:
            raise FileNotFoundError(f"TRITON_HOME={home} has no bin/tritonserver")
        raise FileNotFoundError(
            "no tritonserver found: run `make setup` (extracts one into .triton/) or set TRITON_HOME"
        )


LOOPBACK = "127.0.0.1"
ADMIN_HEADER = "batchlm-admin"  # the header the restricted APIs ask for
# The administrative APIs (Triton's names): restricted on every server the project starts. Inference,
# health, metadata, model configuration and statistics stay open to every client that reaches the port.
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
# A route of each restricted API that changes nothing, to check that the server took its key (start())
_RESTRICTED_PROBES = {"model-repository": ("POST", "/v2/repository/index"), "logging": ("GET", "/v2/logging"),
                      "trace": ("GET", "/v2/trace/setting"),
                      "shared-memory": ("GET", "/v2/systemsharedmemory/status")}
_WARNED_TOKEN_SHOWN = False  # the warning that a key is on a command line: once per process
# The most seconds from tritonserver's exec to its preloaded library blanking the key (milliseconds seen)
TOKEN_TAKEN_TIMEOUT_S = 10.0
NGC_BACKENDS = Path("/opt/tritonserver/backends")  # where an NGC container's tritonserver has its backends
_HANDED_OUT: set[int] = set()  # ports free_port() returned in this process


def free_port() -> int:
    """A TCP port that is free on loopback right now, and not one this process was given before.

    The kernel may hand out the port it just freed again: two calls in a row could give one server the
    same HTTP and metrics port, and tritonserver would refuse to start."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


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
        # NOTE: restrictions given in extra_args replace these (tritonserver takes one key per API)
        return bool(self.restricted_apis) and not any(
            a.startswith(("--http-restricted-api", "--grpc-restricted-protocol")) for a in self.extra_args)

    @property
    def token_hidden(self) -> bool:
        """Whether admin_token stays off the server's command line (argv_secret: its placeholder is
        there, the token reaches tritonserver through its environment); False where nothing is
        restricted or the library cannot be built."""
        return self._restricts() and self._secret_preload is not None

    @functools.cached_property
    def _secret_preload(self) -> Path | None:
        """The library that keeps admin_token off the command line (argv_secret), looked up once; None
        where it cannot be built or used."""
        return argv_secret.library()

    def restriction_args(self) -> list[str]:
        """tritonserver arguments that restrict `restricted_apis` to requests with `admin_header`."""
        if not self._restricts():
            return []
        apis = ",".join(self.restricted_apis)
        token = self.token_placeholder if self.token_hidden else self.admin_token
        return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={token}",
                f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={token}"]

    @property
    def drainable(self) -> bool:
        """Whether drain() can unload this server's models: its arguments choose explicit model control."""
        return model_control_mode(self.extra_args) == "explicit"

    def command(self) -> list[str]:
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
        install = self.install or TritonInstall.find()
        env = dict(os.environ)
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        if sys.prefix != sys.base_prefix:
            env["VIRTUAL_ENV"] = sys.prefix
        if install.lib_dir is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(install.lib_dir), env.get("LD_LIBRARY_PATH", "")) if p
            )
        # NOTE: keep Python from writing __pycache__ next to shared code (Triton treats every
        # folder in the repository as a model).
        env["PYTHONDONTWRITEBYTECODE"] = "1"
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
            self._await_token_taken()
            self.wait_ready(timeout)
            self._check_restriction()
        except BaseException:  # NOTE: SystemExit from exit_cleanly_on_sigterm too
            self.stop()
            raise
        return self

    def _await_token_taken(self) -> None:
        """Where the key goes through argv_secret: that the library ran in tritonserver (it blanks the key
        in the process's environment before main()), or the start fails at once: without it the key
        would be the placeholder, which every local user can read. Where the key is on the command
        line, say so (once per process)."""
        global _WARNED_TOKEN_SHOWN
        if not self.token_hidden:
            if self._restricts() and not _WARNED_TOKEN_SHOWN:
                _WARNED_TOKEN_SHOWN = True
                print("batchlm: WARNING: batchlm/launcher/argv_secret.c could not be built or used (no C compiler?), "
                      "so the key of the administrative APIs is on tritonserver's command line, which every "
                      "local user can read (docs/operations.md, \"Security\")", file=sys.stderr, flush=True)
            return
        deadline = time.monotonic() + TOKEN_TAKEN_TIMEOUT_S
        while not argv_secret.taken(self.process.pid, self.admin_token):
            if self.process.poll() is not None:
                return  # NOTE: wait_ready says why, with the log's tail
            if time.monotonic() > deadline or argv_secret.missing(self.process.pid, self._secret_preload):
                raise RuntimeError("the argv_secret library did not run in tritonserver (not preloaded), so its "
                                   "key would be the placeholder on its command line; not serving")
            time.sleep(0.005)

    def _check_restriction(self) -> None:
        """Where the key came through argv_secret, that tritonserver took it: a restricted API answers
        admin_header. Else the start fails: its key would be the placeholder."""
        if not self.token_hidden:
            return
        api = next((a for a in _RESTRICTED_PROBES if a in self.restricted_apis), None)
        if api is None:
            return
        method, route = _RESTRICTED_PROBES[api]
        request = urllib.request.Request(f"http://{self.http_url}{route}", headers=self.admin_headers, method=method,
                                         data=b"{}" if method == "POST" else None)
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"tritonserver refused its own key on the {api} API (HTTP {exc.code}): the key "
                               "did not take the placeholder's place in its arguments; not serving") from None

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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}{self._log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s{self._log_tail()}")

    def _log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        tail = Path(self.log_path).read_text(errors="replace").splitlines()[-lines:]
        return "\n--- tritonserver log tail ---\n" + "\n".join(tail)

    def load_failures(self) -> list[str]:
        """Why models did not load, in tritonserver's words, from this start's part of the log."""
        if self.log_path is None or not Path(self.log_path).exists():
            return []
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            lines = log.read().decode(errors="replace").splitlines()
        return [m.group(1) for m in map(_LOAD_FAILURE.search, lines) if m]

    def crash_lines(self) -> list[str]:
        """Lines of the server's log that show a process crashing (heap corruption, a fatal signal)."""
        if self.log_path is None or not Path(self.log_path).exists():
            return []
        return [line for line in Path(self.log_path).read_text(errors="replace").splitlines()
                if _CRASH.search(line)]

    def descendants(self) -> list[int]:
        """PIDs of the server's process tree (stubs included), read from /proc."""
        return [] if self.process is None else process_tree(self.process.pid)

    def stubs(self) -> dict[int, str]:
        """Live Python backend stubs of this server: pid -> the model each serves."""
        return {pid: model for pid, (model, _) in self.stub_instances().items()}

    def stub_instances(self) -> dict[int, tuple[str, str]]:
        """Live Python backend stubs of this server: pid -> (model, model instance) each serves."""
        found = {}
        for pid in self.descendants():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            except OSError:
                continue
            # NOTE: a stub's arguments (tritonserver 2.51): <repository>/<model>/<version>/model.py, the
            # shared-memory region, its default and growth sizes, the parent's pid, the backend's folder,
            # the IPC handle, the instance's name ("<model>_0_0"), its device kind
            if argv[0].endswith("triton_python_backend_stub") and len(argv) > 1:
                model = Path(argv[1]).parents[1].name
                # NOTE: a stub of another layout is told apart by its pid, so each one still counts
                found[pid] = (model, argv[8] if len(argv) > 8 and argv[8] else f"{model} (pid {pid})")
        return found

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
        _kill_group(self.process.pid)
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


def process_tree(root: int) -> list[int]:
    """PIDs of every live descendant of `root` (children first), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found.append(child)
            todo.append(child)
    return found


# The serve command's status when it stopped the server because a model failed (--on-model-failure exit)
EXIT_MODEL_FAILED = 3



def model_control_mode(args: list[str] | tuple[str, ...]) -> str:
    """The model control mode that tritonserver arguments `args` choose: the last
    `--model-control-mode=M` or `--model-control-mode M`; "none" (tritonserver's default) where none
    does; "" for a flag left without its value."""
    mode = "none"
    for i, arg in enumerate(args):
        if arg.startswith("--model-control-mode="):
            mode = arg.split("=", 1)[1]
        elif arg == "--model-control-mode":
            mode = args[i + 1] if i + 1 < len(args) else ""
    return mode


def with_model_control(extra: list[str] | tuple[str, ...]) -> list[str]:
    """tritonserver arguments for the serve commands: `extra`, with explicit model control and every
    model loaded at start added where `extra` chooses no mode of its own (a mode chosen in `extra` is
    kept). The repository API that explicit control opens is restricted like every administrative API
    of a `TritonServer` (`TritonServer.restricted_apis`), so only the serve command, which holds the
    header, can unload models, as without explicit model control no client could."""
    extra = list(extra)
    if any(a == "--model-control-mode" or a.startswith("--model-control-mode=") for a in extra):
        return extra
    return ["--model-control-mode=explicit", "--load-model=*", *extra]


def serve_until_signalled(server: TritonServer, drain_timeout: float = 60.0, start_timeout: float = 900.0,
                          on_model_failure: str = "reload") -> int:
    """Start `server`, print a ready line, and serve until SIGINT, SIGTERM or SIGHUP; then drain it where
    it runs in explicit model control (`TritonServer.drainable`; at most `drain_timeout` s; a second
    signal skips the rest) and stop it. Return 0; the server's status if it ended by itself; 1 if it
    exited or was not ready within `start_timeout` s at start (said in one line); EXIT_MODEL_FAILED
    where a model failed under `on_model_failure="exit"`. Progress goes to stderr, prefixed `serve:`.

    While it serves, a `ModelSupervisor` looks every 0.5 s for a model whose stub died or whose serving
    thread stopped: "reload" reloads that model alone, "exit" stops the server at once (every request
    in flight ends with its connection) and returns EXIT_MODEL_FAILED, "off" leaves it to Triton.

    Draining first matters: on SIGTERM tritonserver waits, up to its exit timeout, for every open HTTP
    connection to close before it unloads anything, and a request parked in static_batching keeps its
    connection open until its model is unloaded (see `TritonServer.drain`)."""
    exit_cleanly_on_sigterm()  # NOTE: SIGTERM's default action would end this process before server.stop()
    # NOTE: the signals that stop the server must reach this process even when its parent handed it
    # SIGINT ignored (a job started in the background by a shell without job control) or blocked. The
    # server runs in a session of its own, so a terminal's Ctrl-C reaches this process only.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))
    status, grace = 0, None
    try:
        try:
            try:
                server.start(timeout=start_timeout)
            except (RuntimeError, TimeoutError) as exc:  # NOTE: the server's own log has said why
                _say(f"not serving: {exc}")
                return 1
            print(f"tritonserver ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}",
                  flush=True)
            # NOTE: not signal.pause(): a signal that lands after Python's last check for pending signals
            # and before pause() is entered leaves pause() waiting for the next one, and the server
            # running. A pending signal's handler runs at the latest when this sleep ends.
            supervisor = None if on_model_failure == "off" else ModelSupervisor(server, on_model_failure, _say).start()
            while server.process.poll() is None:
                time.sleep(0.5)
                if supervisor is not None and supervisor.check() and on_model_failure == "exit":
                    _say("stopping the server at once (--on-model-failure exit): every request in flight ends")
                    status, grace = EXIT_MODEL_FAILED, 0.0
                    break
            else:
                status = server.process.returncode or 1
                _say(f"tritonserver exited by itself with status {server.process.returncode}")
        except (KeyboardInterrupt, SystemExit):
            if server.drainable and server.process is not None and server.process.poll() is None:
                _drain(server, drain_timeout)
    finally:
        for signum in STOP_SIGNALS:  # NOTE: nothing may cut the stop short: it removes the stubs
            signal.signal(signum, signal.SIG_IGN)
        process = server.process
        server.stop(grace=grace)
        if status == 0 and process is not None and process.returncode:
            _say(f"tritonserver exited with status {process.returncode} (its log says why)")
    return status


def _drain(server: TritonServer, timeout: float) -> None:
    _say(f"draining: unloading every model (at most {timeout:.0f} s); signal again to stop at once")
    try:
        unloaded = server.drain(timeout=timeout)
        _say(f"unloaded {', '.join(unloaded) or 'nothing'}; stopping")
    except (KeyboardInterrupt, SystemExit):
        _say("second signal: stopping without waiting for the drain")
    except (TimeoutError, OSError) as exc:  # NOTE: urllib's URLError and HTTPError are OSErrors
        _say(f"drain incomplete ({exc}); stopping")


def _say(message: str) -> None:
    print(f"serve: {message}", file=sys.stderr, flush=True)


def exit_cleanly_on_sigterm() -> None:
    """Make SIGTERM and SIGHUP raise SystemExit in this (main-thread) process, so `finally` blocks and
    `TritonServer.__exit__` stop the server and its stubs. Without it the default action ends the
    process at once: the server dies with it (PR_SET_PDEATHSIG), but its Python backend stubs, which
    are the server's children, are left running."""
    def _exit(signum, frame):  # noqa: ARG001 - signal handler signature
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit)


def die_with_parent() -> None:
    """Runs in the child before exec: the server gets SIGKILL if the process that started it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
