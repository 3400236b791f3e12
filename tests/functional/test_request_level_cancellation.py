"""static_batching and dynamic_batching: a running batch whose clients cancelled ends early; in every
model, one cancelled request leaves and harms no other.

Without `batchlm.backend.cancel_poll`, such a batch would run to its longest row: 8 rows x 900 tokens,
many seconds of CPU for answers nobody reads, with dynamic batching's next batch waiting behind it.
"""

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm.request_schema import request_fields
from batchlm_client.triton_llm import LLMClient, chunk_from_grpc, grpc_inputs
from tests.functional.conftest import metric_reaches, metric_value

ROOT = Path(__file__).resolve().parents[2]
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
    waiting, rather than keeping the count from before the drop until the next request comes: with
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


LENGTH = 120
PROMPTS = [f"Row {i} of the batch" for i in range(ROWS)]


@pytest.fixture(scope="module")
def alone():
    """Each prompt's greedy text from the engine in process (batched: its rows do not change each other's
    text, tests/functional/test_schema_and_equality.py)."""
    engine = LLMEngine(ROOT / "models" / "tiny-random", EngineConfig(num_threads=1))
    return [out.text for out in engine.generate(PROMPTS, SamplingParams(max_tokens=LENGTH, ignore_eos=True))]


@pytest.mark.parametrize("model", ["static_batching", "dynamic_batching", "continuous_batching"])
def test_one_cancelled_request_leaves_and_the_others_get_their_whole_answers(server, alone, model):
    """One client of eight cancels mid-generation: its row leaves (its tokens stop), and each of the other
    seven gets the very text it gets alone, to its last token."""
    length, prompts = LENGTH, PROMPTS
    metadata = LLMClient(server.http_url, server.grpc_url)
    config = metadata.model_config(model)
    metadata.close()
    before = _settled(server, model, quiet=0.3)
    answers: dict[int, list] = {i: [] for i in range(ROWS)}
    clients = []
    try:
        for i, prompt in enumerate(prompts):
            c = grpcclient.InferenceServerClient(server.grpc_url)
            clients.append(c)
            c.start_stream(callback=lambda result, error, i=i: answers[i].append((result, error)))
            c.async_stream_infer(model, grpc_inputs(request_fields(prompt, length, ignore_eos=True), config))
        deadline = time.monotonic() + 60
        while _tokens(server, model) - before < 2 * ROWS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _tokens(server, model) - before >= 2 * ROWS, "the batch did not start"
        clients[0].stop_stream(cancel_requests=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(answers[i] for i in range(1, ROWS)):
            time.sleep(0.1)
        got = {i: list(answers[i]) for i in range(ROWS)}  # before the streams close (a close can add an error)
    finally:
        for i, c in enumerate(clients):
            # NOTE: cancel only what is still running: cancelling a stream whose request had ended left
            # tritonserver 2.51 holding the model (batchlm_client.triton_llm.LLMClient.stream_grpc)
            c.stop_stream(cancel_requests=not answers[i])
            c.close()
    answers = got
    for i in range(1, ROWS):
        assert len(answers[i]) == 1 and answers[i][0][1] is None, (i, answers[i])
        chunk = chunk_from_grpc(answers[i][0][0])
        assert (chunk.text, chunk.finish_reason, chunk.num_output_tokens) == (alone[i], "length", length), i
    generated = _settled(server, model, quiet=0.5) - before
    # Had the cancelled row run on, 8 x 120 tokens; it stops within a check period and a step of noticing
    # (dynamic batching may run it alone, at its fastest, for the first tokens: three quarters of it)
    assert generated < (ROWS - 1) * length + 0.75 * length, f"{generated:.0f} tokens: the cancelled row ran on"
