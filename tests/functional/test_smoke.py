"""Issue 2's smoke test: the repository loads in a real tritonserver and every model answers over
HTTP generate and gRPC."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from batchlm.serving.instance_claim import default_folder
from batchlm.triton_server import PROJECT_ROOT, free_port, process_tree
from tests.functional.conftest import is_alive

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
    assert http.num_input_tokens == grpc.num_input_tokens > 0
    assert http.text == grpc.text and http.text


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_script_stops_the_server_cleanly_on_a_signal(tmp_path, signum):
    """`scripts/serve.py --log`, stopped as a service manager or a terminal stops it: tritonserver unloads
    every model, and nothing of the server outlives the script (stubs, shared memory, instance claims).
    Before, SIGTERM killed the script at once: no model unloaded, the stubs lingered, and their
    shared-memory regions and claim files stayed behind."""
    shm_before = set(Path("/dev/shm").iterdir())
    log = tmp_path / "server.log"
    ports = [str(free_port()) for _ in range(3)]
    proc = subprocess.Popen([sys.executable, "scripts/serve.py", "--http-port", ports[0], "--grpc-port", ports[1],
                             "--metrics-port", ports[2], "--log", str(log)], cwd=PROJECT_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "tritonserver ready" in proc.stdout.readline()
        tree = process_tree(proc.pid)
        server_pid = next(pid for pid in tree if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                          .endswith(b"tritonserver"))
        assert len([pid for pid in tree if is_alive(pid)]) >= 4  # the server and a stub per model
        # what the script's signal state was, for a failure's message (blocked, ignored, caught: bit masks)
        state = [line.strip() for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                 if line.startswith(("SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd"))]
        proc.send_signal(signum)
        try:
            assert proc.wait(timeout=60) == 0
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve.py did not stop within 60 s of signal {signum}; its signal state: {state}")
        for pid in tree:
            assert not is_alive(pid), f"process {pid} outlived serve.py"
        assert log.read_text().count("successfully unloaded") == len(MODELS)
        assert not list(default_folder().glob(f"{server_pid}-*")), "instance claims left behind"
        assert not [p for p in set(Path("/dev/shm").iterdir()) - shm_before if p.name.startswith("batchlm_")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
