"""continuous_batching: per-step scheduling, streaming, cancellation frees KV within a check period."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import tritonclient.grpc as grpcclient

from batchlm.request_schema import request_fields
from batchlm_client.triton_llm import LLMClient, grpc_inputs
from tests.functional.conftest import metric_reaches, metric_value, repository_api

MODEL = "continuous_batching"


def _client(server):
    return LLMClient(server.http_url, server.grpc_url, timeout=300)


def test_short_request_overtakes_long_one(server):
    def run(prompt, max_tokens, delay):
        time.sleep(delay)
        client = _client(server)
        try:
            result = client.infer_grpc(MODEL, prompt, max_tokens=max_tokens, ignore_eos=True)
            return time.monotonic(), result
        finally:
            client.close()

    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(run, "A long story begins", 300, 0.0)
        short = pool.submit(run, "Short", 5, 0.5)
        (long_done, long_result), (short_done, short_result) = long.result(120), short.result(120)
    assert long_result.num_output_tokens == 300 and short_result.num_output_tokens == 5
    assert short_done < long_done, "the short request waited for the long one"


def test_grpc_stream_delivers_text_before_the_end(server):
    client = _client(server)
    try:
        start = time.perf_counter()
        chunks, times = [], []
        for chunk in client.stream_grpc(MODEL, "Once upon a time", max_tokens=40, ignore_eos=True, stream=True):
            chunks.append(chunk)
            times.append(time.perf_counter() - start)
    finally:
        client.close()
    assert len(chunks) > 5
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 40
    assert all(c.finish_reason == "" for c in chunks[:-1])
    assert times[0] < times[-1] / 2, "the first text came only at the end"
    full = _client(server)
    try:
        assert "".join(c.text for c in chunks) == full.generate(MODEL, "Once upon a time", 40, ignore_eos=True).text
    finally:
        full.close()


def test_http_generate_stream(llm):
    chunks = list(llm.generate_stream(MODEL, "Hello there", max_tokens=12, ignore_eos=True, stream=True))
    assert len(chunks) > 1 and chunks[-1].num_output_tokens == 12
    assert "".join(c.text for c in chunks) == llm.generate(MODEL, "Hello there", 12, ignore_eos=True).text


def test_stream_interval_coalesces_tokens(server):
    """`stream_interval` 4: the first text comes as soon as it exists, then each response carries at
    least 4 new tokens, and the joined text is the same as one response per token."""
    def stream(prompt):
        client = _client(server)
        try:
            return list(client.stream_grpc(MODEL, prompt, max_tokens=41, ignore_eos=True, stream=True))
        finally:
            client.close()

    base = stream("Once upon a time")
    config = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/config", timeout=10).json()
    config["parameters"]["stream_interval"] = {"string_value": "4"}
    r = repository_api(server, MODEL, "load", config)
    assert r.status_code == 200, r.text
    try:
        coalesced = stream("Once upon a time")
    finally:  # back to the repository's config.pbtxt: a load alone would keep the override
        r = repository_api(server, MODEL, "unload", timeout=120)
        assert r.status_code == 200, r.text
        r = repository_api(server, MODEL, "load")
        assert r.status_code == 200, r.text
    counts = [c.num_output_tokens for c in coalesced]
    assert counts[0] == base[0].num_output_tokens, "the first text waited for the interval"
    gaps = [b - a for a, b in zip(counts, counts[1:])]
    assert all(g >= 4 for g in gaps[:-1]) and counts[-1] == 41, counts
    assert 1 + 40 // 4 >= len(coalesced) - 1 >= 40 // 8, counts
    assert len(base) > len(coalesced)
    assert "".join(c.text for c in coalesced) == "".join(c.text for c in base)
    assert coalesced[-1].finish_reason == "length"
    restored = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/config", timeout=10).json()
    assert restored["parameters"]["stream_interval"]["string_value"] == "1"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole-answer"])
def test_cancelled_requests_free_their_kv(server, stream):
    """A streamed request learns of cancellation from a failed send or the cancellation watcher; a whole-
    answer one (nothing is sent until it ends) only from the watcher. Counted in tokens, not seconds:
    run to the end the four requests make 3200, cancelled they stop within a check period and a step."""
    clients = []
    received = []

    def on_response(result, error):
        received.append(error is None)

    before = metric_value(server, "batchlm_generated_tokens_total", MODEL) or 0.0
    try:
        for i in range(4):
            c = grpcclient.InferenceServerClient(server.grpc_url)
            clients.append(c)
            c.start_stream(callback=on_response)
            fields = request_fields(f"Cancel me {i}", 800, ignore_eos=True, stream=stream)
            c.async_stream_infer(MODEL, grpc_inputs(fields))
        deadline = time.monotonic() + 60  # all 4 running, and (streamed) some tokens sent
        while time.monotonic() < deadline and not (
                metric_value(server, "batchlm_running_requests", MODEL) == 4 and (not stream or len(received) >= 20)):
            time.sleep(0.05)
        assert metric_value(server, "batchlm_running_requests", MODEL) == 4, "requests did not start"
        assert metric_value(server, "batchlm_kv_blocks_used", MODEL) > 0
        assert received.count(True) == (len(received) if stream else 0)
    finally:  # NOTE: always: a stream left open holds the model, and the server, past the test
        for c in clients:
            c.stop_stream(cancel_requests=True)
            c.close()
    assert metric_reaches(server, "batchlm_kv_blocks_used", MODEL, 0, timeout=60) == 0
    generated = metric_value(server, "batchlm_generated_tokens_total", MODEL) - before
    # A quarter of 3200 leaves a loaded CI machine seconds of slack (a step at 4 sequences is ~10 ms).
    assert generated < 4 * 800 / 4, f"{generated:.0f} tokens generated for cancelled requests"
    # The model keeps serving after the cancellations.
    client = _client(server)
    try:
        assert client.generate(MODEL, "Still there?", 4, ignore_eos=True).num_output_tokens == 4
    finally:
        client.close()


def test_metrics_published(server, llm):
    llm.generate(MODEL, "Count my tokens", 8, ignore_eos=True)
    for name in ("batchlm_forward_sequences", "batchlm_forward_passes_total", "batchlm_waiting_requests",
                 "batchlm_kv_blocks_total", "batchlm_generated_tokens_total",
                 "batchlm_time_to_first_token_seconds_count"):
        assert metric_value(server, name, MODEL) is not None, name
    config = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/config", timeout=10).json()
    assert metric_value(server, "batchlm_kv_blocks_total", MODEL) == int(
        config["parameters"]["num_kv_blocks"]["string_value"])
    assert metric_value(server, "batchlm_waiting_requests", MODEL) == 0
    assert metric_value(server, "batchlm_forward_passes_total", MODEL) >= 8  # a prefill and 7 decodes at least
    assert metric_value(server, "batchlm_generated_tokens_total", MODEL) >= 8
    assert metric_value(server, "batchlm_time_to_first_token_seconds_count", MODEL) >= 1


def test_unload_drains_streams_in_flight(server):
    """Triton unloads a decoupled model once its requests are done: every stream in flight gets all of
    its tokens, in order, then the model unloads (and loads again)."""
    events: dict[int, list] = {i: [] for i in range(3)}
    clients = []
    for i in range(3):
        c = grpcclient.InferenceServerClient(server.grpc_url)
        c.start_stream(callback=lambda result, error, i=i: events[i].append((result, error)))
        c.async_stream_infer(MODEL, grpc_inputs(request_fields(f"Unload me {i}", 300, ignore_eos=True,
                                                                stream=True)))
        clients.append(c)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(len(e) for e in events.values()) < 5:
            time.sleep(0.05)
        assert min(len(e) for e in events.values()) >= 5, "the streams did not start"
        r = repository_api(server, MODEL, "unload", timeout=120)
        assert r.status_code == 200
        assert requests.get(f"http://{server.http_url}/v2/models/{MODEL}/ready", timeout=10).status_code != 200
        deadline = time.monotonic() + 60

        def ended(stream):
            return stream[-1][1] is not None or stream[-1][0].as_numpy("finish_reason")[0] != b""

        while time.monotonic() < deadline and not all(ended(e) for e in events.values()):
            time.sleep(0.1)
        time.sleep(0.5)  # nothing may follow the end
        for i, stream in events.items():
            assert all(error is None for _, error in stream), (i, [e for _, e in stream if e][:1])
            counts = [int(result.as_numpy("num_output_tokens")[0]) for result, _ in stream]
            assert counts == sorted(counts) and counts[-1] == 300, (i, counts[-3:])
            assert stream[-1][0].as_numpy("finish_reason")[0] == b"length", i
    finally:
        for c in clients:
            c.stop_stream()
            c.close()
        r = repository_api(server, MODEL, "load", timeout=300)
        assert r.status_code == 200
    client = _client(server)
    try:
        assert client.generate(MODEL, "Back again?", 4, ignore_eos=True).num_output_tokens == 4
    finally:
        client.close()


def test_overload_refuses_beyond_max_waiting_however_the_engine_thread_is_timed(server):
    """With one sequence slot held by a long request, `max_waiting` 4 admits exactly 4 of a burst of 24
    and refuses 20. Were requests the engine thread has just taken from the inbox counted nowhere
    until its next step ends, a burst arriving during steps would get far more than 4 in."""
    config = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/config", timeout=10).json()
    config["parameters"]["max_num_seqs"] = {"string_value": "1"}
    config["parameters"]["max_waiting"] = {"string_value": "4"}
    r = repository_api(server, MODEL, "load", config)
    assert r.status_code == 200, r.text
    generate = f"http://{server.http_url}/v2/models/{MODEL}/generate"

    def send(max_tokens):
        r = requests.post(generate, json={"text_input": "Hello", "max_tokens": max_tokens, "ignore_eos": True},
                          timeout=300)
        return time.monotonic(), r.status_code, r.json()

    try:
        with ThreadPoolExecutor(13) as pool:
            long = pool.submit(send, 500)
            assert metric_reaches(server, "batchlm_running_requests", MODEL, 1, timeout=30) == 1
            burst = list(pool.map(send, [1] * 24))
            long_done, long_status, _ = long.result(300)
    finally:  # back to the repository's config.pbtxt: a load alone would keep the override
        r = repository_api(server, MODEL, "unload", timeout=120)
        assert r.status_code == 200, r.text
        r = repository_api(server, MODEL, "load")
        assert r.status_code == 200, r.text
    refused = [body for _, status, body in burst if status != 200]
    assert long_status == 200 and len(burst) - len(refused) == 4, [s for _, s, _ in burst]
    # /generate answers 400 for every model error; the prefix tells a refusal to retry from bad input
    assert all(b["error"] == "UNAVAILABLE: continuous_batching is overloaded: 4 requests already waiting"
               for b in refused), refused[:1]
    assert max(t for t, s, _ in burst if s != 200) < long_done  # every refusal came while the slot was held
