"""The smoke test: the repository loads in a real tritonserver and every model answers over
HTTP generate and gRPC."""

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from batchlm.backend.instance_claim import clear_claims, default_folder
from batchlm.launcher.ports import free_port
from batchlm.launcher.processes import process_tree
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import PROJECT_ROOT
from batchlm_client.triton_llm import LLMClient, RequestFailed
from tests.functional.conftest import held_by_http_connections, is_alive, metric_reaches

MODELS = ("static_batching", "dynamic_batching", "continuous_batching")


def test_server_and_models_ready(server):
    for name in MODELS:
        r = requests.get(f"http://{server.http_url}/v2/models/{name}/ready", timeout=10)
        assert r.status_code == 200, name


@pytest.mark.parametrize("name", ["dynamic_batching", "continuous_batching"])
def test_answers_over_http_and_grpc(llm, name):
    http = llm.generate(name, "The quick brown fox", max_tokens=6, ignore_eos=True)
    grpc = llm.infer_grpc(name, "The quick brown fox", max_tokens=6, ignore_eos=True)
    assert http.num_output_tokens == grpc.num_output_tokens == 6
    assert http.finish_reason == grpc.finish_reason == "length"
    prompt_ids = Tokenizer.from_dir(PROJECT_ROOT / "models" / "tiny-random").encode("The quick brown fox")
    assert http.num_input_tokens == grpc.num_input_tokens == len(prompt_ids)  # BOS and the prompt's tokens
    assert http.text == grpc.text and http.text


@pytest.mark.parametrize("signum, foreground", [
    (signal.SIGTERM, False),
    pytest.param(signal.SIGINT, True, marks=pytest.mark.slow),  # the same drain, from a terminal
])
def test_serve_script_drains_and_stops_the_server_on_a_signal(tmp_path, signum, foreground):
    """Signalled as a service manager (SIGTERM, log to a file) or a terminal (SIGINT, log on its stdout)
    signals it, with two HTTP requests parked in static_batching, `scripts/serve.py` drains and stops
    the server: the parked requests are answered UNAVAILABLE, tritonserver unloads every model and exits
    without waiting out its exit timeout, and nothing of the server outlives the script (stubs, shared
    memory, instance claims). The repository API that drains it is refused to other clients. The
    frontend's API key, given in $BATCHLM_API_KEY, reaches the frontend alone and no process's command
    line. `-s` prints the time from the signal to the script's exit."""
    shm_before = set(Path("/dev/shm").iterdir())
    out, log = tmp_path / "stdout.txt", tmp_path / "server.log"
    ports = [str(free_port()) for _ in range(3)]
    frontend = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, "scripts/serve.py", "--http-port", ports[0], "--grpc-port", ports[1],
               "--metrics-port", ports[2], "--frontend-port", frontend.rpartition(":")[2],
               *([] if foreground else ["--log", str(log)])]
    key = f"sk-smoke-{os.getpid()}-{signum}"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "BATCHLM_API_KEY": key})
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while "OpenAI frontend ready" not in out.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text(errors="replace")[-3000:]
            time.sleep(0.25)
        tree = process_tree(proc.pid)
        server_pid = next(pid for pid in tree if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                          .endswith(b"tritonserver"))
        assert len([pid for pid in tree if is_alive(pid)]) >= 5  # the server, a stub per model, the frontend
        _check_the_api_key(tree, server_pid, frontend, key)
        # what the script's signal state was, for a failure's message (blocked, ignored, caught: bit masks)
        state = [line.strip() for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                 if line.startswith(("SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd"))]
        # the repository API is the script's alone: a client cannot unload a model. (NOTE: connections
        # closed by the server, or an open one would keep the SIGTERM below waiting.)
        once = {"Connection": "close"}
        refused = requests.post(f"http://127.0.0.1:{ports[0]}/v2/repository/models/static_batching/unload",
                                headers=once, timeout=30)
        assert refused.status_code == 403 and "restricted" in refused.text, refused.text
        assert requests.get(f"http://127.0.0.1:{ports[0]}/v2/models/static_batching/ready", headers=once,
                            timeout=30).ok
        with ThreadPoolExecutor(2) as pool:
            parked = [pool.submit(_parked_answer, f"127.0.0.1:{ports[0]}", i) for i in range(2)]
            metrics = SimpleNamespace(metrics_url=f"http://127.0.0.1:{ports[2]}/metrics")
            assert metric_reaches(metrics, "batchlm_waiting_requests", "static_batching", 2, timeout=30) == 2
            assert not any(f.done() for f in parked)
            signalled = time.monotonic()
            proc.send_signal(signum)
            try:
                assert proc.wait(timeout=60) == 0, out.read_text(errors="replace")[-3000:]
            except subprocess.TimeoutExpired:
                pytest.fail(f"serve.py did not stop within 60 s of signal {signum}; its signal state: {state}")
            print(f"serve.py stopped {time.monotonic() - signalled:.1f} s after signal {signum}")
            answers = [f.result(timeout=10) for f in parked]
        for status, message in answers:
            assert status == "503" and "unloaded before a full batch" in message, (status, message)
        for pid in tree:
            assert not is_alive(pid), f"process {pid} outlived serve.py"
        text = (out if foreground else log).read_text(errors="replace")
        assert text.count("successfully unloaded") == len(MODELS), text[-3000:]
        assert "Exit timeout expired" not in text and not held_by_http_connections(text), text[-3000:]
        assert not list(default_folder().glob(f"{server_pid}-*")), "instance claims left behind"
        assert not [p for p in set(Path("/dev/shm").iterdir()) - shm_before if p.name.startswith("batchlm_")]
    finally:  # NOTE: on a failure, leave nothing behind for the tests after this one
        _leave_nothing(proc, process_tree(proc.pid) + tree, shm_before)


def _check_the_api_key(tree: list[int], server_pid: int, frontend: str, key: str) -> None:
    """The key is on no command line of the serve script's tree, in the frontend's environment only, and
    the frontend asks for it: 401 without it, 200 with it; /health is open."""
    alive = [pid for pid in tree if is_alive(pid)]
    for pid in alive:
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    holders = [pid for pid in alive if key.encode() in Path(f"/proc/{pid}/environ").read_bytes()]
    frontends = [pid for pid in alive if b"batchlm.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(frontends) == 1 and holders == frontends, (holders, frontends, server_pid)  # not the server, stubs
    once = {"Connection": "close"}
    assert requests.get(f"{frontend}/v1/models", headers=once, timeout=30).status_code == 401
    assert requests.get(f"{frontend}/v1/models", headers={**once, "Authorization": f"Bearer {key}"},
                        timeout=30).status_code == 200
    assert requests.get(f"{frontend}/health", headers=once, timeout=30).status_code == 200


def test_serve_script_says_in_one_line_why_it_is_not_serving(tmp_path):
    """A port already taken: tritonserver's log says so and exits 1 before it is ready; the script exits
    1 with one line of its own on stderr (not a traceback) and leaves nothing behind. (An empty model
    repository: the server binds its ports only once the models have loaded.)"""
    shm_before = set(Path("/dev/shm").iterdir())
    (tmp_path / "empty").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [str(taken.getsockname()[1]), str(free_port()), str(free_port())]
        out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with open(out, "wb") as out_sink, open(err, "wb") as err_sink:
            proc = subprocess.run([sys.executable, "scripts/serve.py", "--model-repository", str(tmp_path / "empty"),
                                   "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
                                   "--frontend-port", str(free_port())],
                                  cwd=PROJECT_ROOT,
                                  stdout=out_sink, stderr=err_sink, timeout=300)
    text = err.read_text(errors="replace")
    assert proc.returncode == 1 and "Traceback" not in text, text
    assert [line for line in text.splitlines() if line.startswith("serve:")] == [
        "serve: not serving: tritonserver exited with 1"], text
    assert "already in use" in out.read_text(errors="replace")  # the server's log, on the script's stdout
    assert not [p for p in set(Path("/dev/shm").iterdir()) - shm_before if p.name.startswith("batchlm_")]


def _parked_answer(http_url: str, i: int) -> tuple[str, str]:
    """A request to static_batching over HTTP /infer, parked until the batch fills or the model goes:
    the status and message it fails with."""
    client = LLMClient(http_url, timeout=120)
    try:
        client.infer_http("static_batching", f"parked {i}", max_tokens=4)
    except RequestFailed as exc:
        return exc.status, exc.message
    finally:
        client.close()
    return "200", "answered"


@pytest.mark.parametrize("when", [pytest.param("starting, 0.5 s in", marks=pytest.mark.slow),  # the handle kept
                                  "starting, 2 s in", "stopping, signalled 6 times"])
def test_a_signal_while_the_serve_script_starts_or_stops_leaves_nothing_behind(tmp_path, when):
    """A stop signal that lands while tritonserver is being started (before its handle is kept, or while
    its models load) or while it is being stopped (signals repeated as an impatient user or service
    manager sends them): the script still ends, and no process, shared-memory region or instance claim of
    its server is left."""
    shm_before = set(Path("/dev/shm").iterdir())
    out = tmp_path / "stdout.txt"
    ports = [str(free_port()) for _ in range(3)]
    command = [sys.executable, "scripts/serve.py", "--http-port", ports[0], "--grpc-port", ports[1],
               "--metrics-port", ports[2], "--no-frontend", "--log", str(tmp_path / "server.log"), "--",
               "--model-control-mode=explicit", "--load-model=dynamic_batching"]
    with open(out, "wb") as sink:
        proc = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=sink, stderr=subprocess.STDOUT)
    seen: set[int] = set()

    prefixes: set[str] = set()  # its server's shared-memory prefix (other servers may run beside it)

    def watch(seconds: float) -> None:  # collect every process of the script's tree while waiting
        until = time.monotonic() + seconds
        while time.monotonic() < until and proc.poll() is None:
            for pid in set(process_tree(proc.pid)) - seen:
                seen.add(pid)
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                except OSError:
                    continue
                prefixes.update(a.rsplit("=", 1)[1] for a in argv if "shm-region-prefix-name=" in a)
            time.sleep(0.02)

    try:
        if when.startswith("starting"):
            watch(0.5 if "0.5" in when else 2.0)
            assert "tritonserver ready" not in out.read_text(errors="replace")
            proc.send_signal(signal.SIGTERM)
        else:
            deadline = time.monotonic() + 300
            while "tritonserver ready" not in out.read_text(errors="replace"):
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text(errors="replace")[-3000:]
                watch(0.25)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) * 2:
                proc.send_signal(signum)
                watch(0.15)
        watch(60.0)  # until the script has ended, at most 60 s
        assert proc.poll() in (0, 1), out.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
        assert not [pid for pid in seen if is_alive(pid)], (seen, out.read_text(errors="replace")[-3000:])
        assert len(prefixes) <= 1, prefixes
        assert not [p for p in Path("/dev/shm").iterdir() for prefix in prefixes if p.name.startswith(prefix)]
        assert not [path for pid in seen for path in default_folder().glob(f"{pid}-*")], "instance claims left"
    finally:
        _leave_nothing(proc, seen, shm_before)


def _leave_nothing(proc: subprocess.Popen, pids, shm_before: set[Path]) -> None:
    """After a failure: kill the script and every process of its tree, and remove their instance claims
    and new shared-memory regions, so that nothing is left for the tests after it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)
        clear_claims(pid)  # NOTE: the server's among them names its stubs' instance claims
    for region in set(Path("/dev/shm").iterdir()) - shm_before:
        if region.name.startswith("batchlm_"):
            region.unlink(missing_ok=True)
