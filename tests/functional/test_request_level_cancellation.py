"""static_batching and dynamic_batching: a running batch whose clients cancelled ends early.

Before `batchlm.serving.cancel_poll`, such a batch ran to its longest row: 8 rows x 900 tokens, many
seconds of CPU for answers nobody would read, with dynamic batching's next batch waiting behind it.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as grpcclient

from client.triton_llm import LLMClient, grpc_inputs, request_fields
from tests.functional.conftest import metric_reaches, metric_value

ROWS = 8
MAX_TOKENS = 900  # a short prompt + 900 fits max_model_len (1024); at ~10 ms a step, about 9 s a batch


def _tokens(server, model) -> float:
    return metric_value(server, "batchlm_generated_tokens_total", model) or 0.0


def _settled(server, model, quiet: float = 1.0, limit: float = 60.0) -> float:
    """The model's generated-token counter once it has not moved for `quiet` seconds."""
    deadline = time.monotonic() + limit
    last = _tokens(server, model)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = _tokens(server, model)
        if now == last:
            return now
        last = now
    return last


@pytest.mark.parametrize("model", ["static_batching", "dynamic_batching"])
def test_a_batch_whose_clients_cancelled_stops_generating(server, model):
    before = _settled(server, model, quiet=0.3)
    clients = []
    metadata = LLMClient(server.http_url, server.grpc_url)
    config = metadata.model_config(model)  # batched or not: dynamic batching's inputs get a batch dimension
    metadata.close()
    try:
        for i in range(ROWS):  # one stream each, as Locust's gRPC users send them
            c = grpcclient.InferenceServerClient(server.grpc_url)
            clients.append(c)
            c.start_stream(callback=lambda result, error: None)
            c.async_stream_infer(model, grpc_inputs(request_fields(f"Cancel me {i}", MAX_TOKENS, ignore_eos=True),
                                                    config))
        deadline = time.monotonic() + 60
        while _tokens(server, model) - before < 2 * ROWS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _tokens(server, model) - before >= 2 * ROWS, "the batch did not start"
    finally:  # NOTE: always: a request left running or parked holds the model past the test
        for c in clients:
            c.stop_stream(cancel_requests=True)
            c.close()
    generated = _settled(server, model) - before
    # Run to the end, the batch makes 8 x 900 = 7200 tokens; cancelled, it stops within a check period
    # (100 ms) and a step of noticing. A quarter leaves a loaded CI machine seconds of slack.
    assert generated < ROWS * MAX_TOKENS / 4, f"{generated:.0f} tokens generated for cancelled requests"
    # The model keeps serving (a full batch, which static batching waits for).
    with ThreadPoolExecutor(ROWS) as pool:
        results = list(pool.map(lambda i: _ask(server, model, i), range(ROWS)))
    assert [r.num_output_tokens for r in results] == [4] * ROWS


def _ask(server, model, i):
    client = LLMClient(server.http_url, server.grpc_url, timeout=120)
    try:
        return client.infer_grpc(model, f"Still there {i}?", 4, ignore_eos=True)
    finally:
        client.close()


def test_parked_requests_whose_clients_cancelled_leave_the_waiting_gauge(server):
    """static_batching closes parked requests whose clients cancelled (CANCELLED) and then reads 0
    waiting. Before, the gauge kept the count from before the drop until the next request came: with
    nothing parked the watchdog pushes nothing."""
    model = "static_batching"
    metadata = LLMClient(server.http_url, server.grpc_url)
    config = metadata.model_config(model)
    metadata.close()
    errors, clients = [], []
    try:
        for i in range(3):
            c = grpcclient.InferenceServerClient(server.grpc_url)
            clients.append(c)
            c.start_stream(callback=lambda result, error: errors.append(error))
            c.async_stream_infer(model, grpc_inputs(request_fields(f"Parked {i}", 4, ignore_eos=True), config))
        assert metric_reaches(server, "batchlm_waiting_requests", model, 3, timeout=30) == 3
    finally:
        for c in clients:
            c.stop_stream(cancel_requests=True)
            c.close()
    assert metric_reaches(server, "batchlm_waiting_requests", model, 0, timeout=10) == 0
    # and the next full batch is served as before
    with ThreadPoolExecutor(8) as pool:
        assert [r.num_output_tokens for r in pool.map(lambda i: _ask(server, model, i), range(8))] == [4] * 8
