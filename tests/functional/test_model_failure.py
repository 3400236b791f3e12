"""A model that can no longer serve while tritonserver still calls it ready: its stub process killed, or
its serving thread stopped. The serve command's supervisor (batchlm/launcher/supervisor.py) finds both;
`--on-model-failure reload` reloads that model alone while the others go on serving, `exit` stops the
server at once so that no request is left waiting on a dead stub."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from batchlm.backend.instance_claim import clear_claims
from batchlm.launcher.ports import free_port
from batchlm.launcher.processes import process_tree
from batchlm.launcher.serve_loop import EXIT_MODEL_FAILED
from batchlm.launcher.supervisor import ModelSupervisor
from batchlm.paths import PROJECT_ROOT
from batchlm_client.triton_llm import LLMClient, RequestFailed
from tests.functional.conftest import is_alive, metric_reaches, metric_value, repository_api

MODEL = "continuous_batching"


class Serve:
    """`scripts/serve.py` as a user runs it, with `models` loaded."""

    def __init__(self, tmp_path: Path, *options: str, models: tuple[str, ...] = (MODEL, "dynamic_batching")) -> None:
        self.out = tmp_path / "serve.txt"
        self.ports = [free_port() for _ in range(3)]
        self.http = f"127.0.0.1:{self.ports[0]}"
        self.metrics_url = f"http://127.0.0.1:{self.ports[2]}/metrics"
        command = [sys.executable, "scripts/serve.py", "--http-port", str(self.ports[0]),
                   "--grpc-port", str(self.ports[1]), "--metrics-port", str(self.ports[2]), "--no-frontend",
                   "--log", str(tmp_path / "server.log"), *options, "--", "--model-control-mode=explicit",
                   *[f"--load-model={model}" for model in models], "--exit-timeout-secs=3"]
        with open(self.out, "wb") as sink:
            self.proc = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=sink, stderr=subprocess.STDOUT)
        self.tree: list[int] = []

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 300
        while "tritonserver ready" not in self.text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.25)
        self.tree = process_tree(self.proc.pid)

    def stub(self, model: str) -> int:
        for pid in process_tree(self.proc.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"triton_python_backend_stub") and f"/{model}/".encode() in argv[1]:
                return pid
        raise AssertionError(f"no stub of {model}")

    def close(self) -> None:
        left = process_tree(self.proc.pid) + self.tree
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in left:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
            clear_claims(pid)


def _attempt(http: str, model: str, max_tokens: int, timeout: float) -> tuple[str | None, float]:
    """(None, seconds) for a request answered in full, else (its error, seconds)."""
    llm = LLMClient(http, "127.0.0.1:1", timeout=timeout)
    started = time.monotonic()
    try:
        result = llm.generate(model, "The model that failed", max_tokens, ignore_eos=True)
        said = None if result.num_output_tokens == max_tokens else f"{result.num_output_tokens} tokens"
    except (RequestFailed, requests.RequestException) as exc:
        said = str(exc)
    finally:
        llm.close()
    return said, time.monotonic() - started


MODELS = ("static_batching", "dynamic_batching", "continuous_batching")
BATCH = 8  # static_batching's batch_size: it answers nothing until this many requests are there


def _holds(serve: Serve, model: str) -> int:
    """The requests `model`'s instances hold, by their waiting and running gauges."""
    return int(sum(metric_value(serve, name, model) or 0 for name in ("batchlm_waiting_requests",
                                                                       "batchlm_running_requests")))


def _served(http: str, model: str) -> list[tuple[str | None, float]]:
    """A short request answered in full; for static_batching, a full batch of them."""
    n = BATCH if model == "static_batching" else 1
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _attempt(http, model, 4, 30.0), range(n)))


def test_each_killed_stub_is_reloaded_while_the_others_serve_on(tmp_path):
    """kill -9 of each model's stub in turn, with two requests in it (parked in static_batching, running
    in the others); the supervisor names the model and the requests its stub held. The other models
    answer every request throughout; a request sent to the dead model fails with a clear error within
    seconds; the supervisor reloads it and it serves again, with a new stub, within 20 s. The requests
    the dead stub held: dynamic_batching's fail with Triton's "Stub process ... is not healthy";
    static_batching's and continuous_batching's, answered through response senders, are never answered
    by Triton 2.51's Python backend (here their clients give up after 4 s).
    `-s` prints the times."""
    serve = Serve(tmp_path, models=MODELS)
    try:
        serve.wait_ready()
        for model in MODELS:
            old = serve.stub(model)
            others = [m for m in MODELS if m not in (model, "static_batching")]
            with ThreadPoolExecutor(4) as pool:
                # NOTE: Triton fails dynamic_batching's within seconds (4.6 s seen); the others' clients
                # give up after 4 s
                give_up = 12.0 if model == "dynamic_batching" else 4.0
                held = [pool.submit(_attempt, serve.http, model, 900, give_up) for _ in range(2)]
                deadline = time.monotonic() + 10
                while (holds := _holds(serve, model)) < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert holds >= 1, (model, holds)
                killed = time.monotonic()
                os.kill(old, signal.SIGKILL)
                # NOTE: sent at once, it reaches the dead instance (the supervisor looks every 0.5 s and
                # then unloads): Triton's check of the stub's health fails it (3-5 s seen)
                probe = pool.submit(_attempt, serve.http, model, 4, 30.0)
                stop, other = threading.Event(), []

                def keep_asking_the_others() -> None:
                    while not stop.is_set():
                        other.extend((m, *_attempt(serve.http, m, 4, 30.0)) for m in others)

                watcher = pool.submit(keep_asking_the_others)
                while f"serve: {model}: reloaded, serving again" not in serve.text():
                    assert time.monotonic() < killed + 20, f"{model} not reloaded within 20 s: {serve.text()[-3000:]}"
                    time.sleep(0.1)
                reloaded = time.monotonic() - killed
                again = _served(serve.http, model)
                stop.set()
                watcher.result(timeout=60)
                refused, ends = probe.result(timeout=30), [f.result(timeout=30) for f in held]
            print(f"{model}: {holds} requests held, a request to the dead stub failed in {refused[1]:.1f} s, "
                  f"serving again {reloaded:.1f} s after the kill, held requests ended "
                  f"{', '.join(f'{seconds:.1f} s' for _, seconds in ends)} after they were sent, "
                  f"{len(other)} requests to the others")
            assert refused[0] is not None and refused[1] < 8.0, (model, refused)
            assert all(said is None for said, _ in again), (model, again)
            assert other and all(said is None for _, said, _ in other), (model, other)
            assert serve.stub(model) != old
            assert f"serve: {model}: 1 of its 1 stub process(es) died, holding {holds} request(s)" in serve.text()
            if model == "dynamic_batching":
                assert all(said is not None and "is not healthy" in said and seconds < 8.0
                           for said, seconds in ends), ends
            else:  # Triton's limit, which the docs state: nothing answers them
                assert all(said is not None and "timed out" in said for said, _ in ends), (model, ends)
        assert all(said is None for said, _ in _served(serve.http, "static_batching"))
        signalled = time.monotonic()
        serve.proc.send_signal(signal.SIGTERM)
        serve.proc.wait(timeout=90)
        stopped = time.monotonic() - signalled
        print(f"stopped {stopped:.1f} s after SIGTERM")
        # NOTE: the dead stubs' versions still hold their requests, so tritonserver waits out its exit
        # timeout (3 s here); the drain itself does not wait for them
        assert stopped < 15, serve.text()[-3000:]
    finally:
        serve.close()
    assert serve.proc.returncode == 0, serve.text()[-3000:]
    assert not [pid for pid in serve.tree if is_alive(pid)]


def test_exit_policy_ends_every_held_request_at_once(tmp_path):
    """`--on-model-failure exit`: the stub's held requests fail within seconds (their connections
    close with the server), the command exits 3 and leaves no process behind."""
    serve = Serve(tmp_path, "--on-model-failure", "exit")
    try:
        serve.wait_ready()
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(_attempt, serve.http, MODEL, 900, 60.0) for _ in range(2)]
            time.sleep(0.5)
            killed = time.monotonic()
            os.kill(serve.stub(MODEL), signal.SIGKILL)
            assert serve.proc.wait(timeout=30) == EXIT_MODEL_FAILED, serve.text()[-3000:]
            ends = [f.result(timeout=30) for f in held]
        assert all(said is not None for said, _ in ends), ends
        assert time.monotonic() - killed < 10, ends
        assert "stopping the server at once" in serve.text()
    finally:
        serve.close()
    time.sleep(0.5)
    assert not [pid for pid in serve.tree if is_alive(pid)]


def test_a_stopped_serving_thread_reads_down_and_the_supervisor_reloads_it(server):
    """continuous_batching's engine thread dies (fault injection, `loop@3`): its `batchlm_serving_up`
    gauge reads 0, the supervisor names it and reloads the model from the repository (which has no
    fault plan), and the model answers again."""
    config = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/config", timeout=10).json()
    config["parameters"]["fault_injection"] = {"string_value": "loop@3"}
    assert repository_api(server, MODEL, "load", config).status_code == 200
    supervisor = ModelSupervisor(server, "reload", say=lambda _: None).start()
    said, _ = _attempt(server.http_url, MODEL, 32, 30.0)
    assert said is not None and "the engine thread stopped" in said, said
    assert metric_reaches(server, "batchlm_serving_up", MODEL, 0, timeout=10) == 0
    failed = supervisor.check()
    assert [(f.model, f.reason) for f in failed] == [(MODEL, "its serving thread stopped")]
    assert supervisor.reloads[MODEL] == 1
    assert _attempt(server.http_url, MODEL, 8, 30.0)[0] is None
    assert metric_reaches(server, "batchlm_serving_up", MODEL, 1, timeout=10) == 1
    assert supervisor.failures() == []
