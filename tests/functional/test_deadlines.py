"""Triton's per-request `timeout` is honoured by every model: a request whose timeout passes leaves,
waiting or running (its KV freed, its batch place given back), and is answered UNAVAILABLE "request
timeout expired"; the requests beside it are untouched. static_batching's optional `max_wait_ms` runs an
incomplete batch once its oldest request has waited that long."""

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from batchlm.request_schema import request_fields
from batchlm_client.triton_llm import LLMClient, chunk_from_grpc, grpc_inputs
from tests.functional.conftest import metric_reaches, reload_from_repository, repository_api

TIMEOUT_US = 400_000  # 0.4 s: far shorter than the requests it cuts short (hundreds of tokens)


def _config(server, model: str) -> dict:
    client = LLMClient(server.http_url, server.grpc_url)
    try:
        return client.model_config(model)
    finally:
        client.close()


def _infer(server, model: str, prompt: str, max_tokens: int, timeout_us: int | None = None,
           together: threading.Barrier | None = None):
    """One gRPC ModelInfer with Triton's request timeout: (seconds taken, result or the exception). With
    `together`, the client and inputs are made first and the request leaves when every party is ready."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = grpc_inputs(request_fields(prompt, max_tokens, ignore_eos=True), _config(server, model))
    if together is not None:
        together.wait(timeout=60)
    start = time.monotonic()
    try:
        result = client.infer(model, inputs, timeout=timeout_us, client_timeout=120)
        return time.monotonic() - start, result
    except InferenceServerException as exc:
        return time.monotonic() - start, exc
    finally:
        client.close()


def _generate(server, model: str, prompt: str, max_tokens: int):
    client = LLMClient(server.http_url, server.grpc_url, timeout=120)
    try:
        return client.generate(model, prompt, max_tokens=max_tokens, ignore_eos=True)
    finally:
        client.close()


def _is_timeout(answer) -> bool:
    return (isinstance(answer, InferenceServerException) and answer.status() == "StatusCode.UNAVAILABLE"
            and "timeout expired" in answer.message().lower())


def _output_tokens(result) -> int:
    return int(result.as_numpy("num_output_tokens").reshape(-1)[0])


def test_continuous_batching_a_stream_past_its_timeout_ends_with_unavailable_and_frees_its_kv(server):
    model = "continuous_batching"
    assert metric_reaches(server, "batchlm_kv_blocks_used", model, 0, timeout=30) == 0
    config = _config(server, model)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((time.monotonic(), result, error)))
    try:
        with ThreadPoolExecutor(1) as pool:
            beside = pool.submit(_generate, server, model, "Untouched beside it", 120)
            start = time.monotonic()
            client.async_stream_infer(model, grpc_inputs(request_fields("Stop me in time", 900, ignore_eos=True,
                                                                        stream=True), config),
                                      timeout=TIMEOUT_US)
            chunks, error, ended = 0, None, None
            while error is None:
                at, result, error = events.get(timeout=60)
                if result is not None:
                    chunks += 1
                    assert not chunk_from_grpc(result).finish_reason, "ran to its end past its timeout"
                ended = at
            answer = beside.result(timeout=120)
        assert chunks > 0, "no token before the timeout"
        assert ended - start < TIMEOUT_US / 1e6 + 1.0, f"ended {ended - start:.2f} s after it started"
        # NOTE: an error inside a gRPC stream carries no status of its own; the message's prefix says it
        assert "UNAVAILABLE: continuous_batching: request timeout expired" in error.message(), error
        assert answer.num_output_tokens == 120, answer
    finally:
        client.stop_stream()
        client.close()
    assert metric_reaches(server, "batchlm_kv_blocks_used", model, 0, timeout=30) == 0


def test_static_batching_a_parked_request_past_its_timeout_is_answered_and_leaves_the_count(server):
    model = "static_batching"
    elapsed, answer = _infer(server, model, "Alone and in a hurry", 8, TIMEOUT_US)
    assert _is_timeout(answer), answer
    assert TIMEOUT_US / 1e6 <= elapsed < TIMEOUT_US / 1e6 + 1.5, elapsed
    assert metric_reaches(server, "batchlm_waiting_requests", model, 0, timeout=10) == 0


def test_request_level_a_running_row_past_its_timeout_leaves_its_batch_and_the_others_finish(server):
    """static_batching and dynamic_batching: 8 rows, one of 900 tokens with a timeout; it leaves the batch
    at its timeout, answered UNAVAILABLE, and the batch ends with the 7 short rows, not 900 steps later."""
    for model in ("static_batching", "dynamic_batching"):
        with ThreadPoolExecutor(8) as pool:
            long = pool.submit(_infer, server, model, "The long one", 900, TIMEOUT_US)
            time.sleep(0.05)
            short = [pool.submit(_infer, server, model, f"Short {i}", 40) for i in range(7)]
            elapsed, answer = long.result(timeout=120)
            answers = [f.result(timeout=120)[1] for f in short]
        assert _is_timeout(answer), (model, answer)
        assert elapsed < 5.0, (model, elapsed)  # 900 tokens at 8 rows take ~9 s here
        assert [_output_tokens(a) for a in answers] == [40] * 7, model


def test_dynamic_batching_a_queued_request_past_its_timeout_is_refused_by_triton(server):
    """Behind a running batch of 8 long rows, a ninth request waits in Triton's queue; its timeout passes
    there, and Triton refuses it (allow_timeout_override in config.pbtxt)."""
    model = "dynamic_batching"
    # NOTE: the 8 leave together: made one by one (a client, the model's config), they can arrive further
    # apart than max_queue_delay_microseconds on a busy machine, run as two batches, and never be 8 at once
    together = threading.Barrier(8)
    with ThreadPoolExecutor(9) as pool:
        running = [pool.submit(_infer, server, model, f"Long {i}", 300, together=together) for i in range(8)]
        assert metric_reaches(server, "batchlm_running_requests", model, 8, timeout=30) == 8
        elapsed, answer = _infer(server, model, "Queued and in a hurry", 8, TIMEOUT_US)
        assert [_output_tokens(f.result(timeout=120)[1]) for f in running] == [300] * 8
    assert isinstance(answer, InferenceServerException), answer
    assert answer.status() == "StatusCode.UNAVAILABLE" and "timeout" in answer.message().lower(), answer
    assert elapsed < 2.5, elapsed


def test_static_batching_max_wait_runs_an_incomplete_batch(server):
    config = requests.get(f"http://{server.http_url}/v2/models/static_batching/config", timeout=30).json()
    config["parameters"]["max_wait_ms"]["string_value"] = "300"
    assert repository_api(server, "static_batching", "load", config).status_code == 200
    try:
        with ThreadPoolExecutor(3) as pool:
            alone = [pool.submit(_infer, server, "static_batching", f"Three of eight {i}", 6) for i in range(3)]
            answers = [f.result(timeout=60) for f in alone]
        assert [_output_tokens(a) for _, a in answers] == [6, 6, 6], answers
        assert all(elapsed < 3.0 for elapsed, _ in answers), answers
    finally:
        reload_from_repository(server, "static_batching")
    config = requests.get(f"http://{server.http_url}/v2/models/static_batching/config", timeout=30).json()
    assert config["parameters"]["max_wait_ms"]["string_value"] == "0"


def test_a_generate_body_sets_the_timeout_as_a_field(server):
    """HTTP /generate has no request parameters of its own: a `timeout` field (microseconds) reaches the
    model as one, and is honoured like Triton's."""
    start = time.monotonic()
    r = requests.post(f"http://{server.http_url}/v2/models/static_batching/generate",
                      json={"text_input": "Parked, then timed out", "max_tokens": 4, "timeout": TIMEOUT_US}, timeout=60)
    assert r.status_code == 400 and "UNAVAILABLE: static_batching: request timeout expired" in r.json()["error"], r.text
    assert time.monotonic() - start < TIMEOUT_US / 1e6 + 1.5
