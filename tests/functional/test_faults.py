"""No request is left unanswered when something on a model's serving path raises. With the model's
`fault_injection` parameter (batchlm.backend.fault_injection; off as shipped) each fault point raises
once, and the test shows which requests fail, with what, and that the model goes on serving; a dead
engine thread (continuous_batching's, static_batching's worker) fails every held and later request at
once until the model is reloaded. One load per model (each load adds seconds to `make test`);
static_batching runs with batches of 2.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from batchlm_client.triton_llm import LLMClient, RequestFailed
from tests.functional.conftest import metric_reaches, reload_from_repository, repository_api

MODELS = ("continuous_batching", "dynamic_batching", "static_batching")
WIDTH = {"continuous_batching": 1, "dynamic_batching": 1, "static_batching": 2}  # requests that make a batch


@pytest.fixture
def faulty(server):
    """Loads a model with a fault plan (static_batching with batches of 2); the model gets the
    repository's config.pbtxt again afterwards."""
    llm = LLMClient(server.http_url, server.grpc_url, timeout=120)
    loaded: list[str] = []

    def load(model: str, plan: str) -> None:
        config = requests.get(f"http://{server.http_url}/v2/models/{model}/config", timeout=10).json()
        config["parameters"]["fault_injection"] = {"string_value": plan}
        if model == "static_batching":
            config["parameters"]["batch_size"] = {"string_value": "2"}
        loaded.append(model)
        r = repository_api(server, model, "load", config)
        assert r.status_code == 200, r.text

    try:
        yield load, llm
    finally:
        llm.close()
        for model in dict.fromkeys(loaded):
            reload_from_repository(server, model)


def _round(llm: LLMClient, model: str, prompt: str, count: int, max_tokens: int = 4,
           protocol: str = "http") -> list[str | None]:
    """Send `count` requests at once; for each, its error ("[STATUS] message"), or None if it was
    answered in full."""
    def one(i: int) -> str | None:
        try:
            result = llm.answer(protocol, model, f"{prompt} {i}", max_tokens, ignore_eos=True)
        except RequestFailed as exc:
            return str(exc)
        assert result.num_output_tokens == max_tokens
        return None

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def _fails_via(model: str) -> str:
    """The protocol of the rounds that fail: gRPC, whose status says INTERNAL, for the request-level models;
    HTTP /generate for continuous_batching (its gRPC stream's error carries no status, and a client holds
    one stream at a time), which answers every model error with 400."""
    return "http" if model == "continuous_batching" else "grpc"


def _all_internal(said: list[str | None], model: str, message: str) -> bool:
    """Every request failed with `message`, and with status INTERNAL where the protocol tells it."""
    status = "[400] " if model == "continuous_batching" else "[StatusCode.INTERNAL] "
    return all(s is not None and s.startswith(status) and message in s for s in said)


# Passes, with one request (static: one batch of 2) per round: a batch of 4 tokens is 4 steps, so step@6
# is the step round's 2nd step; metrics@3 is a push while the first request is held (continuous: its first
# token; dynamic: its batch's start; static: its submit), the first two being at the load; `loop` counts
# the engine thread's turns (continuous: one a step, one more at each idle wait; it dies about 4 steps into
# the held requests) or the batches (static, dynamic: the 4th, the held one).
PLANS = {"continuous_batching": "admit@2,step@6,metrics@3,loop@16",
         "dynamic_batching": "admit@2,step@6,metrics@3,loop@4",
         "static_batching": "admit@3,step@6,metrics@3,loop@4"}


@pytest.mark.parametrize("model", MODELS)
def test_a_fault_fails_only_the_requests_it_touches_until_a_dead_thread_fails_all(server, faulty, model):
    """admit, step and metrics faults fail only their requests, and the model serves on. A `loop` fault
    kills continuous_batching's engine thread and static_batching's worker: the requests it held, and every
    later one at once, fail until the model is reloaded. dynamic_batching runs each batch inside Triton's
    execute call and has no thread of its own to lose: a BaseException there fails that batch alone."""
    load, llm = faulty
    load(model, PLANS[model])
    width = WIDTH[model]
    assert _round(llm, model, "Before the faults", width) == [None] * width  # a failed metrics push meanwhile
    said = _round(llm, model, "Refused", 1, protocol=_fails_via(model))  # its admission raises: it alone, at once
    assert _all_internal(said, model, "InjectedFault: fault injected at admit, pass"), said
    said = _round(llm, model, "Fails at its step", width, protocol=_fails_via(model))  # steps 5, 6: the 6th raises
    assert _all_internal(said, model, "InjectedFault: fault injected at step, pass 6"), said
    assert requests.get(f"http://{server.http_url}/v2/models/{model}/ready", timeout=10).status_code == 200
    assert _round(llm, model, "After the faults", width) == [None] * width
    assert metric_reaches(server, "batchlm_kv_blocks_used", model, 0, timeout=30) == 0

    if model == "dynamic_batching":
        said = _round(llm, model, "Its batch raises", 1, 64, protocol=_fails_via(model))
        assert _all_internal(said, model, "InjectedThreadDeath: fault injected at loop, pass 4"), said
        assert _round(llm, model, "After the loop failed", width) == [None] * width
        assert metric_reaches(server, "batchlm_serving_up", model, 1, timeout=10) == 1
        return
    # continuous: both run when the thread dies; static: two make the batch it takes, one is parked or refused
    said = _round(llm, model, "Held when the thread dies", width + 1, 64, protocol=_fails_via(model))
    loop = PLANS[model].rsplit("@", 1)[1]
    assert _all_internal(said, model, f"EngineStopped: {model}: the engine thread stopped (InjectedThreadDeath: "
                                      f"fault injected at loop, pass {loop}); reload the model"), said
    started = time.monotonic()
    said = _round(llm, model, "Sent after", 1)  # static_batching: alone, it would wait for a second request
    assert all(s is not None and "the engine thread stopped" in s and "reload the model" in s for s in said), said
    assert time.monotonic() - started < 2.0, "a request to a stopped engine thread was not failed at once"
    assert metric_reaches(server, "batchlm_serving_up", model, 0, timeout=10) == 0
