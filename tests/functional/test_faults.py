"""No request is left unanswered when something on continuous_batching's engine thread raises. With the
model's `fault_injection` parameter (batchlm.serving.fault_injection; off as shipped) each fault point
raises once, and the test shows which requests fail, with what, and that the model goes on serving; a
dead engine thread fails every held and later request at once until the model is reloaded."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from client.triton_llm import LLMClient, RequestFailed
from tests.functional.conftest import metric_reaches, repository_api

MODEL = "continuous_batching"


@pytest.fixture(scope="module")
def faulty(server):
    """Loads continuous_batching with a fault plan; the repository's config.pbtxt again afterwards."""
    llm = LLMClient(server.http_url, server.grpc_url, timeout=120)

    def load(plan: str) -> None:
        config = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/config", timeout=10).json()
        config["parameters"]["fault_injection"] = {"string_value": plan}
        r = repository_api(server, MODEL, "load", config)
        assert r.status_code == 200, r.text

    try:
        yield load, llm
    finally:
        llm.close()
        assert repository_api(server, MODEL, "unload", timeout=120).status_code == 200
        assert repository_api(server, MODEL, "load").status_code == 200


def _failure(llm: LLMClient, prompt: str, max_tokens: int) -> str | None:
    """The error message of a /generate request, or None if it was answered in full."""
    try:
        result = llm.generate(MODEL, prompt, max_tokens, ignore_eos=True)
    except RequestFailed as exc:
        return str(exc)
    assert result.num_output_tokens == max_tokens
    return None


def _ready(server) -> bool:
    return requests.get(f"http://{server.http_url}/v2/models/{MODEL}/ready", timeout=10).status_code == 200


def test_a_fault_fails_only_the_requests_it_touches_and_the_model_serves_on(server, faulty):
    load, llm = faulty
    load("admit@1,step@3,metrics@2")
    said = _failure(llm, "The first is refused", 8)  # its admission raises
    assert said is not None and "fault injected at admit" in said, said
    said = _failure(llm, "The second fails at its step", 8)  # steps 1 and 2 pass, the 3rd raises
    assert said is not None and "fault injected at step" in said, said
    assert _ready(server)
    with ThreadPoolExecutor(3) as pool:  # after both faults (and a failed metrics push): all answered
        assert list(pool.map(lambda i: _failure(llm, f"After the faults {i}", 8), range(3))) == [None] * 3
    assert metric_reaches(server, "batchlm_kv_blocks_used", MODEL, 0, timeout=30) == 0


def test_a_dead_engine_thread_fails_every_held_and_later_request_at_once(server, faulty):
    load, llm = faulty
    load("loop@5")  # the thread's 5th turn: the request below has had 4 steps
    said = _failure(llm, "Held when the thread dies", 64)
    assert said is not None and "the engine thread stopped" in said and "reload the model" in said, said
    started = time.monotonic()
    said = _failure(llm, "Sent after", 8)
    assert said is not None and "the engine thread stopped" in said, said
    assert time.monotonic() - started < 2.0, "a request to a stopped engine was not failed at once"
