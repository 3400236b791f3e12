"""continuous_batching_trtllm, the shipped front of the TensorRT-LLM engine, served by a real tritonserver.

TensorRT-LLM needs a GPU, so `tensorrt_llm` here is `trtllm_standin/model.py`: the backend's tensor
contract over batchlm's engine, under the inputs and outputs of the shipped
`docker/trtllm/model_repository/tensorrt_llm/config.pbtxt`. Everything else is what the GPU image
serves: the front's config and model.py, its BLS calls, request ids and `stop` requests.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient

from batchlm.bench.served.arrivals import ArrivalSpec
from batchlm.bench.served.benchmark import BenchmarkConfig
from batchlm.bench.served.report import measure
from batchlm.bench.workload import WorkloadSpec, build_requests
from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.launcher.ports import free_port
from batchlm.launcher.triton_server import TritonServer
from batchlm.request_schema import request_fields
from batchlm_client.triton_llm import LLMClient, RequestFailed, grpc_inputs
from tests.functional.conftest import is_alive, metric_reaches
from tests.functional.trtllm_standin import FAILING_AFTER, FAILING_OUTPUT_LEN, standin_repository

ROOT = Path(__file__).resolve().parents[2]
MODEL = "continuous_batching_trtllm"
MAX_IN_FLIGHT = 3
SILENCE_TIMEOUT_MS = 2000
PROMPT = "Once upon a time"


def _repository(repository: Path) -> Path:
    return standin_repository(repository, MAX_IN_FLIGHT, SILENCE_TIMEOUT_MS)


def _server(repository: Path) -> TritonServer:
    return TritonServer(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                        metrics_port=free_port(), log_path=repository.parent / f"{repository.name}.log")


@pytest.fixture(scope="module")
def trt_server(tmp_path_factory):
    srv = _server(_repository(tmp_path_factory.mktemp("trtllm_repository")))
    # NOTE: after the two lost errors below the front may never finish unloading, and the stop waits out
    # the exit timeout (docs/gpu.md): 3 s of it, not 15
    srv.exit_timeout_s = 3
    srv.start(timeout=300)
    yield srv
    tree = srv.descendants()
    srv.stop()
    time.sleep(0.5)
    assert not [pid for pid in tree if is_alive(pid)], "processes left behind"


@pytest.fixture(scope="module")
def reference():
    """The engine in process: what the stand-in's greedy text must be."""
    engine = LLMEngine(ROOT / "models" / "tiny-random", EngineConfig(num_threads=1))

    def text(prompt: str, max_tokens: int) -> str:
        return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].text
    return text


@pytest.fixture
def llm(trt_server):
    client = LLMClient(trt_server.http_url, trt_server.grpc_url, timeout=120)
    yield client
    client.close()


def _stopped_ids(server) -> list[str]:
    return re.findall(r"stand-in stopped (\S+)", Path(server.log_path).read_text(errors="replace"))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_whole_answer_is_the_engines_greedy_text(llm, reference, protocol):
    result = llm.answer(protocol, MODEL, PROMPT, 12, ignore_eos=True)
    assert result.text == reference(PROMPT, 12)
    assert (result.finish_reason, result.num_output_tokens) == ("length", 12)
    assert result.num_input_tokens > 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_stream_sends_the_same_text_in_pieces(llm, reference, protocol):
    chunks = list(llm.stream(protocol, MODEL, PROMPT, 20, ignore_eos=True, stream=True))
    assert len([c for c in chunks if c.text]) > 1
    assert "".join(c.text for c in chunks) == reference(PROMPT, 20)
    assert (chunks[-1].finish_reason, chunks[-1].num_output_tokens) == ("length", 20)


def test_a_stop_string_ends_the_text_and_stops_the_engine_request(llm, trt_server, reference):
    text = reference(PROMPT, 60)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    before = len(_stopped_ids(trt_server))
    result = llm.generate(MODEL, PROMPT, 400, ignore_eos=True, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == text[:text.index(stop)]
    assert result.num_output_tokens < 60
    deadline = time.monotonic() + 10
    while len(_stopped_ids(trt_server)) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_stopped_ids(trt_server)) == before + 1, "the engine request went on after the stop string"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_engine_error_reaches_the_client_and_the_front_goes_on(llm, trt_server, protocol):
    """The engine fails a request part-way (the stand-in's hook): the client gets the engine's message, the
    stop that the front sends after an error finds no running engine request to end (none is logged as
    stopped), and the front serves the next request.
    Not streamed only: on tritonserver 2.51 a decoupled BLS error response that is not the call's first
    never reaches the caller (python_backend r24.10 leaves its id unset; fixed in r25.04), so after
    streamed tokens the front learns of it only from the engine's silence (the next test;
    `tests/functional/bls_threads_repro.py --fail-at 1`)."""
    before = len(_stopped_ids(trt_server))
    with pytest.raises(RequestFailed) as failed:
        llm.answer(protocol, MODEL, PROMPT, FAILING_OUTPUT_LEN, ignore_eos=True)
    assert "stand-in failed" in failed.value.message and f"after {FAILING_AFTER} tokens" in failed.value.message, \
        failed.value.message
    assert llm.generate(MODEL, PROMPT, 3).num_output_tokens == 3
    assert len(_stopped_ids(trt_server)) == before


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_lost_streamed_engine_error_ends_by_the_silence_timeout(llm, trt_server, reference, protocol):
    """Streamed, the stand-in's error after its tokens never reaches the front on tritonserver 2.51
    (python_backend r24.10 leaves the id of a BLS error response that is not the call's first unset).
    After `engine_silence_timeout_ms` of silence the front ends the request: the client gets the
    streamed text and then an error saying so, the engine a stop, and the slot is freed: every one of
    the MAX_IN_FLIGHT slots serves again (both protocols' lost requests would otherwise hold two)."""
    chunks = []
    started = time.monotonic()
    with pytest.raises(RequestFailed) as failed:
        for chunk in llm.stream(protocol, MODEL, PROMPT, FAILING_OUTPUT_LEN, ignore_eos=True, stream=True):
            chunks.append(chunk)
    waited = time.monotonic() - started
    assert "the engine sent nothing" in failed.value.message, failed.value.message
    assert f"after {FAILING_AFTER} tokens" in failed.value.message, failed.value.message
    assert SILENCE_TIMEOUT_MS / 1000 <= waited < 60
    text = "".join(c.text for c in chunks)
    assert text and reference(PROMPT, FAILING_AFTER).startswith(text)
    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        def short(i):
            client = LLMClient(trt_server.http_url, trt_server.grpc_url, timeout=120)
            try:
                return client.generate(MODEL, f"{PROMPT} {i}", 40, ignore_eos=True).num_output_tokens
            finally:
                client.close()
        assert list(pool.map(short, range(MAX_IN_FLIGHT))) == [40] * MAX_IN_FLIGHT


@pytest.mark.parametrize("fields, named", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2000}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"text_input": ""}, "text_input"),
])
def test_bad_input_is_refused_naming_the_field(trt_server, llm, fields, named):
    body = {**request_fields(PROMPT, 4), **fields}
    r = requests.post(f"http://{trt_server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]
    assert llm.generate(MODEL, PROMPT, 3).num_output_tokens == 3  # still serving


def test_requests_beyond_max_in_flight_are_refused_unavailable(trt_server, llm):
    """With `max_in_flight` requests held, one more is refused at once over either transport, naming the
    overload, and the held ones are answered in full. The held ones are not streamed, so nothing is
    recorded while they run: the in-flight gauge reads them all only because the silence sweep pushes it
    (without it, the gauge would read the burst's first until one of them ended)."""
    def held(i):
        client = LLMClient(trt_server.http_url, trt_server.grpc_url, timeout=120)
        try:
            return client.generate(MODEL, f"{PROMPT} {i}", 400, ignore_eos=True)
        finally:
            client.close()

    with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
        running = [pool.submit(held, i) for i in range(MAX_IN_FLIGHT)]
        assert metric_reaches(trt_server, "batchlm_running_requests", MODEL, MAX_IN_FLIGHT, timeout=60) == MAX_IN_FLIGHT
        for protocol, status in (("http", "400"), ("grpc", "grpc")):  # a decoupled model: no code on either
            with pytest.raises(RequestFailed) as info:
                llm.answer(protocol, MODEL, PROMPT, 3)
            assert info.value.status == status, (protocol, info.value)
            assert f"{MODEL} is overloaded: {MAX_IN_FLIGHT} requests already in flight" in info.value.message
        assert not any(f.done() for f in running)
        assert [f.result(timeout=120).num_output_tokens for f in running] == [400] * MAX_IN_FLIGHT
    assert llm.generate(MODEL, PROMPT, 3).num_output_tokens == 3


def test_a_cancelled_stream_stops_its_engine_request(trt_server, llm):
    before = len(_stopped_ids(trt_server))
    client = grpcclient.InferenceServerClient(trt_server.grpc_url)
    received = threading.Event()
    try:
        client.start_stream(callback=lambda result, error: received.set())
        inputs = grpc_inputs(request_fields(PROMPT, 800, ignore_eos=True, stream=True), llm.model_config(MODEL))
        client.async_stream_infer(MODEL, inputs)
        assert received.wait(30)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    deadline = time.monotonic() + 15
    while len(_stopped_ids(trt_server)) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_stopped_ids(trt_server)) == before + 1, "the engine went on generating for a cancelled client"
    assert llm.generate(MODEL, PROMPT, 3).num_output_tokens == 3


def test_the_serving_benchmark_measures_it(trt_server):
    spec = WorkloadSpec(num_requests=4, seed=3, output_mean=12.0, output_cap=24)
    requests_ = build_requests(spec)
    config = BenchmarkConfig(MODEL, trt_server.http_url, trt_server.grpc_url, trt_server.metrics_url,
                             ArrivalSpec.closed_loop(2))
    doc = measure(config, requests_, spec.as_dict())
    summary = doc["summary"]
    assert summary["failures"] == {} and summary["num_ok"] == len(requests_)
    assert [r["num_output_tokens"] for r in doc["requests"]] == [r.max_tokens for r in requests_]
    assert all(0 < r["ttft"] <= r["latency"] for r in doc["requests"])
    assert doc["streamed"] and summary["itl"]["count"] > 0
    counted = sum(sample["generated_tokens"] for sample in doc["timeline"])  # the front's own counter
    assert 0 < counted <= sum(r.max_tokens for r in requests_)


def test_sigterm_with_streams_in_flight_ends_them_and_exits_cleanly(tmp_path):
    """Shutdown drains or fails what is in flight (never leaves a client hanging), and the server exits by
    itself, leaving no stub behind: the front's workers and the stand-in's engine thread both stop.
    NOTE: the clients close their gRPC streams after the SIGTERM, as a client does when it is done: while a
    client keeps a stream open, tritonserver 2.51 unloads no decoupled model and does not exit, even past
    its exit timeout (continuous_batching alike; docs/operations.md, "Why drain before the SIGTERM").
    NOTE: the drain must fit the exit timeout. Past it, tritonserver 2.51 exits "immediately" with models
    still loaded, and then aborts in the Python backend (`malloc(): unaligned tcache chunk detected`) or
    hangs for good in its gRPC server's shutdown, with the clients waiting for their streams. So
    the streams ask for 300 tokens and the server gets 60 s, and the clients' wait is bounded here."""
    srv = _server(_repository(tmp_path / "shutdown_repository"))
    srv.exit_timeout_s = 60
    srv.start(timeout=300)
    events: dict[int, list] = {i: [] for i in range(2)}
    clients = []
    try:
        for i in range(2):
            c = grpcclient.InferenceServerClient(srv.grpc_url)
            c.start_stream(callback=lambda result, error, i=i: events[i].append((result, error)))
            c.async_stream_infer(MODEL, grpc_inputs(request_fields(f"Stop me {i}", 300, ignore_eos=True, stream=True)))
            clients.append(c)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(len(e) for e in events.values()) < 5:
            time.sleep(0.05)
        assert min(len(e) for e in events.values()) >= 5, "the streams did not start"
        assert max(len(e) for e in events.values()) < 300, "a stream ended before the SIGTERM"
        tree = srv.descendants()
        srv.process.send_signal(signal.SIGTERM)
        # stop_stream waits for what is in flight on the stream: in threads, so a stream that never ends
        # fails the test instead of hanging it
        closing = [threading.Thread(target=c.stop_stream, daemon=True) for c in clients]
        for t in closing:
            t.start()
        for t in closing:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in closing), "a stream never ended: its client would hang"
        assert srv.process.wait(timeout=90) == 0, "tritonserver did not exit by itself"
        time.sleep(0.5)
        assert not [pid for pid in tree if is_alive(pid)], "processes left behind"
        for i, stream in events.items():
            result, error = stream[-1]
            drained = error is None and result.as_numpy("finish_reason")[0] == b"length" \
                and result.as_numpy("num_output_tokens")[0] == 300
            failed = error is not None and f"{MODEL} was unloaded before the request finished" in str(error)
            assert drained or failed, (i, len(stream), error)
    finally:
        srv.stop()  # NOTE: first: a stream still open ends with the server, so closing its client returns
        for c in clients:
            c.close()
