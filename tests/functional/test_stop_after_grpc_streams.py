"""A SIGTERM right after streamed gRPC requests to every model: tritonserver unloads all of them and exits 0
without waiting out its exit timeout.

tritonserver 2.51 holds a model for as long as a gRPC stream whose request had already ended is
cancelled: its unload never finishes, and a SIGTERM waits out the exit timeout and exits 1 with the model
loaded. A client that cancelled every stream when it ended made a stop after a Locust run against each
model wait out the exit timeout every time (4 of 4 tries); the project's client and Locust gRPC user
cancel only a request still running (`LLMClient.stream_grpc`). This test streams with
`LLMClient` the way those runs did: 8 clients per model, each with its own gRPC channel, under the
benchmark's long gRPC idle wake-up (`_quiet_grpc_waits`), and one stream abandoned mid-way (which is
cancelled, as a request still running). The race is the client's timing: with every stream cancelled
at its end (a scratch patch of `stop_stream`) the stop waited out the exit timeout with one or two
models still loaded in 6 of 6 runs under the long wake-up (3 of them with two requests per client),
and in 0 of 1 without it (two per client). The unload through the repository API after a benchmark
run is checked by `test_benchmark.py::test_a_streamed_grpc_run_leaves_the_model_free_to_unload`.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

from batchlm.bench.served.benchmark import _quiet_grpc_waits
from batchlm.launcher.ports import free_port
from batchlm.launcher.triton_server import TritonServer
from batchlm_client.triton_llm import LLMClient, collect
from tests.functional.conftest import is_alive

MODELS = ("static_batching", "dynamic_batching", "continuous_batching")
CLIENTS = 8  # per model: a full batch for static_batching
EXIT_TIMEOUT_S = 10


def _streamed(server: TritonServer, model: str, i: int) -> int | None:
    """One request over a gRPC stream of a client of its own; the output tokens counted."""
    client = LLMClient(server.http_url, server.grpc_url, timeout=120)
    try:
        options = {"stream": True} if model == "continuous_batching" else {}
        return collect(client.stream_grpc(model, f"Client {i} asks", max_tokens=8, ignore_eos=True,
                                          **options)).num_output_tokens
    finally:
        client.close()


def _abandoned_stream(server: TritonServer) -> None:
    """A continuous_batching stream whose caller stops reading after its first chunk: the client
    cancels the request, still running, and closes the stream."""
    client = LLMClient(server.http_url, server.grpc_url, timeout=120)
    try:
        chunks = client.stream_grpc("continuous_batching", "An abandoned stream", max_tokens=400,
                                    ignore_eos=True, stream=True)
        next(chunks)
        chunks.close()
    finally:
        client.close()


def test_a_stop_after_streamed_grpc_requests_unloads_every_model_at_once(tmp_path):
    log = tmp_path / "server.log"
    server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_path=log,
                          exit_timeout_s=EXIT_TIMEOUT_S)
    server.start(timeout=300)
    tree = server.descendants()
    try:
        _abandoned_stream(server)
        with _quiet_grpc_waits(), ThreadPoolExecutor(CLIENTS * len(MODELS)) as pool:
            runs = {(model, i): pool.submit(_streamed, server, model, i) for model in MODELS for i in range(CLIENTS)}
            counts = {key: f.result(timeout=240) for key, f in runs.items()}
        assert set(counts.values()) == {8}, counts
        process = server.process
        started = time.monotonic()
        server.stop(grace=EXIT_TIMEOUT_S + 20)
        took = time.monotonic() - started
    finally:
        server.stop()
    time.sleep(0.5)
    assert not [pid for pid in tree if is_alive(pid)], "processes left behind by tritonserver"
    text = log.read_text(errors="replace")
    unloaded = re.findall(r"successfully unloaded '([a-z_]*)'", text)
    assert sorted(unloaded) == sorted(MODELS), text[-3000:]
    assert process.returncode == 0 and "Exit timeout expired" not in text, text[-3000:]
    assert took < EXIT_TIMEOUT_S, f"the stop took {took:.1f} s"
