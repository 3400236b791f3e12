"""The OpenAI-compatible frontend against the shared tritonserver, driven by the official openai SDK.

The frontend runs as a real uvicorn process (batchlm/launcher/frontend_process.py, as `make serve` starts it) on
a free port, talking to the session's server over gRPC. Outputs are kept short (8 to 16 tokens).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

from batchlm.model.chat_template import load_chat_template
from batchlm.launcher.frontend_process import FrontendProcess
from batchlm.launcher.ports import free_port
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import TINY_MODEL_DIR, PROJECT_ROOT
from batchlm_client.triton_llm import LLMClient
from tests.functional.conftest import is_alive, metric_reaches, metric_value, repository_api

MODELS = ("static_batching", "dynamic_batching", "continuous_batching")
TOKENS = 8
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def frontend(server, tmp_path_factory):
    process = FrontendProcess(server.grpc_url, port=free_port(), graceful_timeout=2,
                              log_path=tmp_path_factory.mktemp("frontend") / "frontend.log")
    process.start(timeout=60)
    yield process.url
    pid = process.process.pid
    process.stop()
    assert process.process is None and not is_alive(pid)


KEY = "sk-batchlm-test-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed_frontend(server, tmp_path_factory):
    """A second frontend on the same server, started with an API key as `batchlm-serve` starts it."""
    process = FrontendProcess(server.grpc_url, port=free_port(), graceful_timeout=2, api_key=KEY,
                              log_path=tmp_path_factory.mktemp("keyed_frontend") / "frontend.log")
    process.start(timeout=60)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def sdk(frontend):
    client = openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def triton(server):
    client = LLMClient(server.http_url, server.grpc_url, timeout=120)
    yield client
    client.close()


def _chat_prompt(text: str) -> str:
    return load_chat_template(TINY_MODEL_DIR).render([{"role": "user", "content": text}])


def _reference(triton: LLMClient, prompt: str, tokens: int = TOKENS):
    """Greedy text through Triton's /generate (every model gives the same greedy text,
    tests/functional/test_schema_and_equality.py; continuous_batching answers alone)."""
    return triton.generate("continuous_batching", prompt, tokens, temperature=0.0, ignore_eos=True)


def _ask(sdk: openai.OpenAI, model: str, kind: str, stream: bool, text: str) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of one completion or chat completion, streamed or not."""
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    if kind == "completion":
        answer = sdk.completions.create(model=model, prompt=text, max_tokens=TOKENS, stream=stream, **usage, **GREEDY)
    else:
        answer = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                             max_tokens=TOKENS, stream=stream, **usage, **GREEDY)
    if not stream:
        choice = answer.choices[0]
        return (choice.text if kind == "completion" else choice.message.content), choice.finish_reason, answer.usage
    texts, finish, last_usage, chunks = [], None, None, list(answer)
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == [] and chunk is chunks[-1]  # the usage chunk comes last, alone
            last_usage = chunk.usage
        for choice in chunk.choices:
            texts.append((choice.text if kind == "completion" else choice.delta.content) or "")
            finish = choice.finish_reason or finish
    return "".join(texts), finish, last_usage


def _metric_reaches_at_least(server, name: str, model: str, value: float, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while (metric_value(server, name, model) or 0) < value and time.monotonic() < deadline:
        time.sleep(0.05)
    return (metric_value(server, name, model) or 0) >= value


def _metric_above_zero(server, name: str, model: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not (metric_value(server, name, model) or 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return (metric_value(server, name, model) or 0) > 0


def test_models_lists_the_ready_strategies(sdk):
    assert {m.id for m in sdk.models.list()} == set(MODELS)  # no continuous_batching_trtllm on this server
    assert sdk.models.retrieve("dynamic_batching").id == "dynamic_batching"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("continuous_batching_trtllm")


@pytest.mark.parametrize("model", ["continuous_batching", "dynamic_batching"])
def test_greedy_text_and_usage_equal_tritons_generate_streamed_or_not(sdk, triton, model):
    """dynamic_batching cannot stream: its streamed answers come as one chunk of text."""
    prompt = "Once upon a time"
    for kind, reference in (("completion", _reference(triton, prompt)),
                            ("chat", _reference(triton, _chat_prompt(prompt)))):
        for stream in (False, True):
            text, finish, usage = _ask(sdk, model, kind, stream, prompt)
            assert text == reference.text, (kind, stream)
            assert finish == "length"
            assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
                reference.num_input_tokens, TOKENS, reference.num_input_tokens + TOKENS)


def test_static_batching_answers_eight_openai_requests_as_one_batch(sdk, triton):
    """static_batching answers only full batches of 8: eight SDK calls, of every kind, make one."""
    asks = [(kind, stream, f"Row {i} of the batch") for i, (kind, stream) in
            enumerate([(k, s) for k in ("completion", "chat") for s in (False, True)] * 2)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda a: _ask(sdk, "static_batching", *a), asks))
    for (kind, stream, text), (answer, finish, usage) in zip(asks, answers):
        prompt = text if kind == "completion" else _chat_prompt(text)
        assert answer == _reference(triton, prompt).text, (kind, stream)
        assert finish == "length" and usage.completion_tokens == TOKENS


def test_stream_events_have_openais_shape(frontend):
    # a message with a key of the client's own (lm-evaluation-harness sends `type`) and a name
    message = {"role": "user", "content": "Hi", "type": "message", "name": "ada"}
    body = {"model": "continuous_batching", "messages": [message], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with requests.post(f"{frontend}/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["delta"] == {} and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("path, body, status, param", [
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),                 # the model's INVALID_ARG
    ("completions", {"prompt": "hi", "top_p": 1.5, "stream": True}, 400, "top_p"),         # ... before a stream
    ("completions", {"prompt": "", "max_tokens": 4}, 400, "prompt"),                        # text_input -> prompt
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
     400, "max_completion_tokens"),
    ("completions", {"prompt": "hi", "n": 9}, 400, "n"),
    ("completions", {"prompt": [[1, 10**6]], "max_tokens": 1}, 400, "prompt"),          # input_ids -> prompt
    # the engine's ranges, named as sent: each parameter reaches the engine
    ("completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "frequency_penalty": -2.5, "stream": True}, 400, "frequency_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"100000": 5}},
     400, "logit_bias"),
    ("completions", {"prompt": "hi", "guided_regex": "("}, 400, "guided_regex"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ("completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice"),
    ("completions", {"prompt": "hi", "temprature": 0.5}, 400, "temprature"),
    ("completions", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "stop": ["x"] * 17}, 400, "stop"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
])
def test_bad_input_is_a_400_naming_the_parameter(frontend, path, body, status, param):
    r = requests.post(f"{frontend}/v1/{path}", json={"model": "continuous_batching", **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert error["type"] == "invalid_request_error"


def test_the_sdk_sees_unknown_models_as_404_and_refusals_as_400(sdk):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        sdk.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="unknown model"):  # servable, but not on this server
        sdk.completions.create(model="continuous_batching_trtllm", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="must be between 1 and 8"):
        sdk.chat.completions.create(model="dynamic_batching", n=9, max_tokens=4,
                                    messages=[{"role": "user", "content": "hi"}])


def test_a_client_that_leaves_a_stream_frees_its_kv(server, frontend):
    model = "continuous_batching"
    body = {"model": model, "prompt": "Cancel me", "max_tokens": 900, "ignore_eos": True, "stream": True}
    before = metric_value(server, "batchlm_generated_tokens_total", model) or 0.0
    with requests.post(f"{frontend}/v1/completions", json=body, stream=True, timeout=60) as r:
        events = r.iter_lines()
        assert sum(1 for line, _ in zip(events, range(6)) if line) >= 3  # a few tokens came
        assert _metric_above_zero(server, "batchlm_kv_blocks_used", model)
    left = time.monotonic()
    assert metric_reaches(server, "batchlm_kv_blocks_used", model, 0, timeout=10) == 0
    freed_after = time.monotonic() - left
    generated = metric_value(server, "batchlm_generated_tokens_total", model) - before
    assert generated < 900 / 2, f"{generated:.0f} tokens generated for a stream whose client left"
    assert freed_after < 5
    assert _frontend_running_reaches_zero(frontend, model)


def test_a_client_that_leaves_a_parked_request_cancels_it(server, frontend):
    """static_batching parks a lone request until 7 more come; its client gives up, and the frontend
    cancels the Triton request, which the model closes (its watchdog checks every 0.5 s)."""
    model = "static_batching"
    body = {"model": model, "prompt": "Parked", "max_tokens": 4}
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(requests.post, f"{frontend}/v1/completions", json=body, timeout=2.0)
        assert metric_reaches(server, "batchlm_waiting_requests", model, 1, timeout=5) == 1
        with pytest.raises(requests.Timeout):
            asked.result()
    assert metric_reaches(server, "batchlm_waiting_requests", model, 0, timeout=10) == 0
    assert _frontend_running_reaches_zero(frontend, model)


def test_concurrent_streams_each_get_their_whole_answer(sdk, triton):
    prompts = [f"Stream {i} says" for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: _ask(sdk, "continuous_batching", "completion", True, p), prompts))
    for prompt, (text, finish, usage) in zip(prompts, answers):
        assert text == _reference(triton, prompt).text and finish == "length" and usage.completion_tokens == TOKENS


def test_locust_openai_user_reports_ttft_and_e2e(frontend, tmp_path):
    """locustfiles/openai_user.py, headless for 3 s (and the answers still on their way): streamed chats, TTFT
    before E2E, no failure."""
    prefix, log = tmp_path / "run", tmp_path / "locust.log"
    command = [str(Path(sys.executable).parent / "locust"), "-f", "locustfiles/openai_user.py", "--headless",
               "--host", frontend, "--model", "continuous_batching", "-u", "2", "-r", "2", "-t", "3s",
               "--stop-timeout", "60", "--csv", str(prefix), "--output-mean", "8", "--output-cap", "16"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {f"{r['Type']} {r['Name']}": r for r in csv.DictReader(f) if r["Type"]}
    assert set(rows) == {"TTFT openai continuous_batching", "E2E openai continuous_batching"}, rows
    for row in rows.values():
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
        assert float(row["Average Content Size"]) > 0
    assert float(rows["TTFT openai continuous_batching"]["Average Response Time"]) < \
        float(rows["E2E openai continuous_batching"]["Average Response Time"])


@pytest.mark.slow  # NOTE: tooling beside serving (the benchmark's own server and frontend); make test-slow runs it
def test_the_serving_benchmark_runs_through_the_frontend(tmp_path):
    """`batchlm-bench run --protocol openai --start-server`: its own tritonserver and frontend, every
    request streamed through /v1/completions, each answered with exactly the tokens it asked for."""
    command = [str(Path(sys.executable).parent / "batchlm-bench"), "run", "continuous_batching", "--protocol",
               "openai", "--start-server", "--concurrency", "2", "--num-requests", "4", "--output-mean", "4",
               "--output-cap", "8", "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "no failures" in proc.stdout
    doc = json.loads(next(tmp_path.glob("continuous_batching-*.json")).read_text())
    assert doc["protocol"] == "openai" and doc["streamed"]
    requests_ = doc["requests"]
    assert len(requests_) == 4 and all(r["error"] is None for r in requests_)
    assert [r["num_output_tokens"] for r in requests_] == [r["max_tokens"] for r in requests_]
    assert doc["summary"]["output_tokens"] == sum(r["max_tokens"] for r in requests_)
    assert all(r["chunk_times"] and r["ttft"] == r["chunk_times"][0] for r in requests_)


def test_an_overloaded_model_is_a_429_in_openais_error_shape(server, frontend):
    """continuous_batching with one sequence slot and one waiting place, sent a burst of 8 long requests
    through the frontend, streamed and not: those beyond the slot and the waiting place get 429
    `rate_limit_error` / `overloaded`; the others are answered in full, and the model keeps serving."""
    model = "continuous_batching"
    config = requests.get(f"http://{server.http_url}/v2/models/{model}/config", timeout=10).json()
    config["parameters"]["max_num_seqs"] = {"string_value": "1"}
    config["parameters"]["max_waiting"] = {"string_value": "1"}
    r = repository_api(server, model, "load", config)
    assert r.status_code == 200, r.text

    def send(i):
        body = {"model": model, "prompt": f"Burst {i}", "max_tokens": 64, "ignore_eos": True, "stream": i % 2 == 1}
        with requests.post(f"{frontend}/v1/completions", json=body, stream=True, timeout=120) as r:
            return r.status_code, r.headers.get("content-type", ""), r.content

    try:
        with ThreadPoolExecutor(8) as pool:
            burst = list(pool.map(send, range(8)))
        after = requests.post(f"{frontend}/v1/completions", timeout=60, json={
            "model": model, "prompt": "Still serving?", "max_tokens": 4, "ignore_eos": True})
    finally:  # back to the repository's config.pbtxt: a load alone would keep the override
        r = repository_api(server, model, "unload", timeout=120)
        assert r.status_code == 200, r.text
        r = repository_api(server, model, "load")
        assert r.status_code == 200, r.text
    statuses = [status for status, _, _ in burst]
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    for status, content_type, content in burst:
        if status == 429:  # a plain HTTP error, streamed or not: the model refused before any text
            assert content_type.startswith("application/json")
            error = json.loads(content)["error"]
            assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "overloaded", None)
            assert f"{model} is overloaded" in error["message"]
        elif content_type.startswith("text/event-stream"):
            assert content.decode().rstrip().endswith("data: [DONE]") and b'"error"' not in content
        else:
            assert json.loads(content)["usage"]["completion_tokens"] == 64
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    r = requests.post(f"{frontend}/v1/completions", timeout=60, json={   # and with its own config again
        "model": model, "prompt": "Back again?", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _frontend_metrics(frontend: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the frontend's /metrics: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{frontend}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _frontend_running_reaches_zero(frontend: str, model: str, timeout: float = 10.0) -> bool:
    """Whether the frontend's `batchlm:num_requests_running` for `model` reads 0 within `timeout`: a
    request whose client left ends there too."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _frontend_metrics(frontend).get(("batchlm:num_requests_running", (("model_name", model),))) == 0:
            return True
        time.sleep(0.2)
    return False


def test_the_frontend_counts_its_requests_at_its_own_metrics(frontend, sdk):
    model = "continuous_batching"
    before = _frontend_metrics(frontend)
    plain = sdk.completions.create(model=model, prompt="Count me", max_tokens=4, **GREEDY)
    streamed = list(sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "And me"}],
                                                max_tokens=3, stream=True, stream_options={"include_usage": True},
                                                **GREEDY))
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=model, prompt="Refused", max_tokens=0)
    after = _frontend_metrics(frontend)
    label = (("model_name", model),)

    def grew(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(label + labels)))
        return after.get(key, 0.0) - before.get(key, 0.0)

    usage = [plain.usage, streamed[-1].usage]
    assert grew("batchlm:request_success_total", ("finished_reason", "length")) == 2
    assert grew("batchlm:request_failure_total", ("status", "400")) == 1
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert grew(f"batchlm:{histogram}_count") == 2, histogram
        assert grew(f"batchlm:{histogram}_sum") > 0, histogram
    assert grew("batchlm:generation_tokens_total") == sum(u.completion_tokens for u in usage) == 7
    assert grew("batchlm:prompt_tokens_total") == sum(u.prompt_tokens for u in usage) > 0
    assert after[("batchlm:num_requests_running", label)] == 0


# the tiny checkpoint's special tokens: the models' text leaves them out, the log-probabilities show them
SPECIALS = {t.content for t in Tokenizer.from_dir(TINY_MODEL_DIR).hf.get_added_tokens_decoder().values() if t.special}


def _check_logprobs(values: list[float]) -> None:
    assert all(math.isfinite(v) and v <= 0 for v in values), values
    assert math.isfinite(sum(values))


def test_chat_logprobs_parse_into_the_sdks_types_streamed_or_not(sdk, triton):
    """Greedy: each token is the most likely, so its log-probability is the top alternative's; the tokens'
    bytes make the answer's text."""
    prompt = "Once upon a time"
    ask = {"model": "continuous_batching", "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS,
           "logprobs": True, "top_logprobs": 3, **GREEDY}
    choice = sdk.chat.completions.create(**ask).choices[0]
    content = choice.logprobs.content
    assert choice.message.content == _reference(triton, _chat_prompt(prompt)).text
    assert len(content) == TOKENS and all(isinstance(t, ChatCompletionTokenLogprob) for t in content)
    for token in content:
        top = token.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert (token.token, token.logprob) == (top[0].token, top[0].logprob)
        _check_logprobs([token.logprob, *(t.logprob for t in top)])
    said = b"".join(bytes(t.bytes) for t in content if t.token not in SPECIALS)
    assert said.decode("utf-8", errors="replace") == choice.message.content
    streamed = [c.choices[0].logprobs for c in sdk.chat.completions.create(**ask, stream=True) if c.choices]
    assert [t for lp in streamed if lp is not None for t in lp.content] == content


@pytest.mark.parametrize("model", ["continuous_batching", "dynamic_batching"])
def test_completion_echo_logprobs_hold_the_prompts_tokens_then_the_answers(sdk, triton, model):
    prompt = "Once upon a time"
    answer = sdk.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, logprobs=1, echo=True, **GREEDY)
    choice, reference = answer.choices[0], _reference(triton, prompt)
    logprobs, text = choice.logprobs, choice.text
    assert text == prompt + reference.text
    assert len(logprobs.tokens) == reference.num_input_tokens + TOKENS == answer.usage.total_tokens
    assert logprobs.tokens[0] == "<s>" and logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens[1:reference.num_input_tokens]) == prompt
    ends = [*logprobs.text_offset[1:], len(text)]
    for token, start, end in zip(logprobs.tokens, logprobs.text_offset, ends):
        if token not in SPECIALS and "\ufffd" not in token:
            assert text[start:end] == token, (token, start, end)
    _check_logprobs(logprobs.token_logprobs[1:])
    for logprob, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert logprob <= next(iter(top.values())) == max(top.values()) and len(top) <= 2  # the most likely first
    for token, logprob, top in zip(*(lp[reference.num_input_tokens:] for lp in (
            logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))):
        assert top == {token: logprob}   # greedy: the chosen token is the most likely


def test_echo_with_max_tokens_0_scores_the_prompt_alone(sdk):
    prompt = "Once upon a time"
    scored = sdk.completions.create(model="continuous_batching", prompt=prompt, max_tokens=0, logprobs=0, echo=True,
                                    temperature=0.0)
    logprobs = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert len(logprobs.tokens) == scored.usage.prompt_tokens and logprobs.top_logprobs[0] is None
    assert all(top == {token: lp} for token, lp, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:],
                                                           logprobs.top_logprobs[1:]))
    _check_logprobs(logprobs.token_logprobs[1:])


def test_tokenize_counts_what_the_engine_counts_and_detokenize_inverts_it(frontend, sdk, triton):
    model, text = "continuous_batching", "Tokens, counted twice"
    said = requests.post(f"{frontend}/tokenize", json={"model": model, "prompt": text}, timeout=30).json()
    engine = triton.generate(model, text, 1, temperature=0.0)
    assert said["count"] == len(said["tokens"]) == engine.num_input_tokens and said["max_model_len"] == 1024
    messages = [{"role": "user", "content": text}]
    chat = requests.post(f"{frontend}/tokenize", json={"model": model, "messages": messages}, timeout=30).json()
    answer = sdk.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0.0)
    assert chat["count"] == answer.usage.prompt_tokens > said["count"]
    bare = requests.post(f"{frontend}/tokenize", timeout=30,
                         json={"model": model, "prompt": text, "add_special_tokens": False}).json()["tokens"]
    back = requests.post(f"{frontend}/detokenize", json={"model": model, "tokens": bare}, timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": text}
    refused = requests.post(f"{frontend}/detokenize", json={"model": model, "tokens": [-1]}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"


def test_lm_evaluation_harness_remote_tokenizer_reads_the_frontend(frontend):
    """What `tokenizer_backend=remote` asks, with no model named: /tokenizer_info, /tokenize, /detokenize."""
    utils = pytest.importorskip("lm_eval.utils")
    base = f"{frontend}/v1/completions"
    assert utils.check_remote_tokenizer_support(base)
    tokenizer = utils.RemoteTokenizer(base)
    text = "Tokens, counted twice"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    bos = Tokenizer.from_dir(TINY_MODEL_DIR).bos_token_id
    assert (tokenizer.eos_token, tokenizer.bos_token, tokenizer.bos_token_id) == ("</s>", "<s>", bos)
    assert "add_generation_prompt" in tokenizer.tokenizer_info["chat_template"]


def test_token_prompts_answer_as_their_text_and_a_list_answers_each_in_order(frontend, sdk, triton):
    model, texts = "continuous_batching", ["Once upon a time", "The cat sat on"]
    ids = [requests.post(f"{frontend}/tokenize", json={"prompt": t}, timeout=30).json()["tokens"] for t in texts]
    answer = sdk.completions.create(model=model, prompt=ids, max_tokens=TOKENS, **GREEDY)
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.text for c in answer.choices] == [_reference(triton, t).text for t in texts]
    assert answer.usage.prompt_tokens == sum(map(len, ids)) and answer.usage.completion_tokens == 2 * TOKENS
    # lm-evaluation-harness' scoring of token prompts: the echoed text is the prompt's
    scored = sdk.completions.create(model=model, prompt=[ids[0]], max_tokens=1, echo=True, logprobs=1, temperature=0)
    logprobs = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(texts[0]) and len(logprobs.token_logprobs) == len(ids[0]) + 1
    texts_answer = sdk.completions.create(model=model, prompt=texts, max_tokens=TOKENS, **GREEDY)
    assert [c.text for c in texts_answer.choices] == [c.text for c in answer.choices]


TINY = Tokenizer.from_dir(TINY_MODEL_DIR)


def test_logit_bias_forces_a_token_and_min_tokens_holds_eos_back(sdk):
    model = "continuous_batching"
    forced = TINY.encode("hello")[-1]
    answer = sdk.completions.create(model=model, prompt="Once upon a time", max_tokens=4, logprobs=0,
                                    logit_bias={str(forced): 100}, temperature=0, extra_body={"ignore_eos": True})
    assert set(answer.choices[0].logprobs.tokens) == {TINY.hf.id_to_token(forced)}
    eos = {str(min(TINY.eos_token_ids)): 100}
    ended = sdk.completions.create(model=model, prompt="Once upon a time", max_tokens=8, logit_bias=eos,
                                   temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens <= 1
    held = sdk.completions.create(model=model, prompt="Once upon a time", max_tokens=8, logit_bias=eos,
                                  temperature=0, extra_body={"min_tokens": 4})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens >= 4


def test_n_choices_are_the_requests_seeded_seed_and_seed_plus_1_and_share_the_prompts_kv(server, sdk):
    model = "continuous_batching"
    prompt = f"Seeded choices ({time.time_ns()}) share a prompt that fills a few blocks of the cache " * 3
    sampled = {"model": model, "max_tokens": TOKENS, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    hits = metric_value(server, "batchlm_prefix_cache_hits_total", model) or 0
    both = sdk.completions.create(prompt=prompt, n=2, seed=11, **sampled)
    # the second choice read the first's prompt blocks (the model counts them once its step is done)
    assert _metric_reaches_at_least(server, "batchlm_prefix_cache_hits_total", model, hits + 16)
    alone = [sdk.completions.create(prompt=prompt, seed=seed, **sampled) for seed in (11, 12)]
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert (both.usage.prompt_tokens, both.usage.completion_tokens) == (alone[0].usage.prompt_tokens, 2 * TOKENS)
    messages = [{"role": "user", "content": "Two ways"}]
    whole = sdk.chat.completions.create(model=model, messages=messages, n=2, seed=3, max_tokens=TOKENS)
    texts = {0: "", 1: ""}
    for chunk in sdk.chat.completions.create(model=model, messages=messages, n=2, seed=3, max_tokens=TOKENS,
                                             stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_structured_output_parses_into_the_sdks_pydantic_model(sdk):
    """`.parse()` sends a strict JSON schema; the engine holds the tiny random model's answer to it."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        age: int = Field(ge=0, le=9)
        vaccinated: bool

    model = "continuous_batching"
    parsed = sdk.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Describe a pet."}],
                                        response_format=Pet, max_tokens=96, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Pet), parsed.choices[0].message.content
    choice = sdk.completions.create(model=model, prompt="Pick one:", max_tokens=16, temperature=1.0, seed=2,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].text in ("red", "green", "blue")
    digits = sdk.completions.create(model=model, prompt="Three digits:", max_tokens=16, temperature=1.0, seed=2,
                                    extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text)


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(sdk):
    model = "continuous_batching"
    prompt = f"A long prompt, asked twice ({time.time_ns()}), is read from the cache the second time. " * 4
    first, second = (sdk.completions.create(model=model, prompt=prompt, max_tokens=2, **GREEDY) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    streamed = list(sdk.completions.create(model=model, prompt=prompt, max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context(frontend, sdk):
    model = "continuous_batching"
    messages = [{"role": "user", "content": "Go on for as long as you may"}]
    prompt = requests.post(f"{frontend}/tokenize", json={"model": model, "messages": messages}, timeout=30).json()
    answer = sdk.chat.completions.create(model=model, messages=messages, **GREEDY)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens == prompt["count"]
    assert answer.usage.completion_tokens == prompt["max_model_len"] - prompt["count"]


def test_with_an_api_key_the_sdk_is_answered_with_it_and_refused_without(keyed_frontend):
    """A wrong key is the SDK's AuthenticationError, in OpenAI's error shape."""
    url = f"{keyed_frontend.url}/v1"
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60) as right:
        assert {m.id for m in right.models.list()} == set(MODELS)
        answer = right.completions.create(model="continuous_batching", prompt="Hi", max_tokens=2, **GREEDY)
        assert answer.usage.completion_tokens == 2
    with openai.OpenAI(base_url=url, api_key=KEY[:-1] + "0", max_retries=0, timeout=60) as wrong:
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.chat.completions.create(model="continuous_batching", max_tokens=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert refused.value.body == {"message": "incorrect API key", "type": "invalid_request_error",
                                  "param": None, "code": "invalid_api_key"}
    remote = pytest.importorskip("lm_eval.utils").RemoteTokenizer(f"{url}/completions", auth_token=KEY)
    assert remote.decode(remote.encode("Hi there")) == "Hi there"


@pytest.mark.parametrize("headers, message", [
    ({}, "no API key"),
    ({"Authorization": f"Basic {KEY}"}, "must be one `Bearer <key>`"),
    ({"Authorization": "Bearer"}, "must be one `Bearer <key>`"),
    ({"Authorization": KEY}, "must be one `Bearer <key>`"),
    ({"Authorization": f"Bearer {KEY}x"}, "incorrect API key"),
])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("GET", "/v1/no-such-route"), ("GET", "/tokenizer_info")])
def test_without_the_key_every_v1_route_is_a_401_in_openais_shape(keyed_frontend, headers, message, method, path):
    body = {"model": "continuous_batching", "prompt": "Hi", "max_tokens": 2}
    r = requests.request(method, f"{keyed_frontend.url}{path}", headers=headers, timeout=30,
                         json=body if method == "POST" else None)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                  "param": None, "code": "invalid_api_key"}}
    assert message in r.json()["error"]["message"] and KEY not in r.text


def test_with_an_api_key_health_and_metrics_stay_open_and_the_key_is_on_no_command_line(keyed_frontend):
    """The key reaches the frontend in its environment, which only its own user reads; its command line,
    which every local user reads, does not carry it (the launcher's side: test_smoke.py)."""
    r = requests.get(f"{keyed_frontend.url}/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"triton_ready": True}
    r = requests.get(f"{keyed_frontend.url}/metrics", timeout=30)
    assert r.status_code == 200 and "batchlm:num_requests_running" in r.text
    pid = keyed_frontend.process.pid
    assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert f"BATCHLM_API_KEY={KEY}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
