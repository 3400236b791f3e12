"""dynamic_batching: Triton forms the batches; a lone request runs after the queue delay."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from batchlm_client.triton_llm import LLMClient, RequestFailed
from tests.functional.conftest import metric_value

MODEL = "dynamic_batching"


def _stats(server):
    r = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/stats", timeout=10)
    s = r.json()["model_stats"][0]
    return s["inference_count"], s["execution_count"], s["inference_stats"]["queue"]


def _send(server, i):
    client = LLMClient(server.http_url, server.grpc_url, timeout=300)
    try:
        return client.generate(MODEL, f"Prompt {i} for the batcher", max_tokens=3 + i % 4, ignore_eos=True)
    finally:
        client.close()


def _idle_stats(server, quiet_s: float = 1.0, timeout_s: float = 60.0):
    """The model's stats once nothing is pending or running in it and its counts have not moved for
    `quiet_s`: requests an earlier test left behind on the shared server are not counted as ours."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        stats = _stats(server)
        pending = metric_value(server, "nv_inference_pending_request_count", MODEL) or 0
        running = metric_value(server, "batchlm_running_requests", MODEL) or 0
        if stats[:2] != last or pending or running:
            last, since = stats[:2], time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return stats
        assert time.monotonic() < deadline, f"{MODEL} never went idle: {pending} pending, {running} running"
        time.sleep(0.1)


def _batch_sizes(server) -> dict[int, int]:
    r = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/stats", timeout=10)
    return {int(b["batch_size"]): int(b["compute_infer"]["count"])
            for b in r.json()["model_stats"][0].get("batch_stats", [])}


def test_concurrent_requests_share_executions(server):
    inf0, exe0, _ = _idle_stats(server)
    sizes0 = _batch_sizes(server)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: _send(server, i), range(16)))
    inf1, exe1, _ = _idle_stats(server)  # the last batch's counts are added after its answers are sent
    sizes = {b: n - sizes0.get(b, 0) for b, n in _batch_sizes(server).items() if n != sizes0.get(b, 0)}
    assert all(r.num_output_tokens == 3 + i % 4 for i, r in enumerate(results))
    assert inf1 - inf0 == 16, f"executions by batch size: {sizes}"
    assert exe1 - exe0 < 16, f"Triton ran every request alone: no batching happened ({sizes})"


def test_lone_request_waits_about_the_queue_delay(server):
    config = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/config", timeout=10).json()
    delay_s = int(config["dynamic_batching"]["max_queue_delay_microseconds"]) / 1e6
    _, _, q0 = _stats(server)
    _send(server, 0)
    _, _, q1 = _stats(server)
    waited = (int(q1["ns"]) - int(q0["ns"])) / 1e9
    assert int(q1["count"]) - int(q0["count"]) == 1
    assert 0.8 * delay_s <= waited <= delay_s + 0.25, f"queued {waited:.3f}s, delay is {delay_s:.3f}s"
    # The gauges were pushed before the answer: nothing runs now (they read 1 until the next request before)
    for name in ("batchlm_running_requests", "batchlm_kv_blocks_used"):
        assert metric_value(server, name, MODEL) == 0, name


def test_stream_is_refused_with_field_named(llm):
    with pytest.raises(RequestFailed) as info:
        llm.generate(MODEL, "hi", max_tokens=4, stream=True)
    assert info.value.status == "400" and "stream" in info.value.message
