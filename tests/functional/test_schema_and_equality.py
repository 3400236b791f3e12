"""One schema for all three models: malformed input is refused naming the field, the server keeps
serving, and greedy decoding gives the same text everywhere, whatever shares the batch."""

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from batchlm.engine.engine import LLMEngine
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import SamplingParams
from batchlm_client.triton_llm import PROTOCOLS, STREAMING_PROTOCOLS, LLMClient, RequestFailed, collect
from tests.functional.conftest import metric_value

MODELS = ("static_batching", "dynamic_batching", "continuous_batching")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["dynamic_batching", "continuous_batching", "static_batching"])
@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 4}, "text_input"),
    ({"text_input": "hi"}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "max_tokens": 4, "top_p": 2.0}, "top_p"),
    ({"text_input": "hi", "max_tokens": 4, "top_k": -1}, "top_k"),
    ({"text_input": "hi", "max_tokens": 100000}, "max_tokens"),
    # a field that matches no input arrives as a request parameter, and is refused, not dropped in silence
    ({"text_input": "hi", "max_tokens": 4, "temprature": 0.7}, "temprature: unknown field"),
    ({"text_input": "hi", "max_tokens": 4, "stop": ["x"] * 17}, "stop: at most 16 stop strings"),
    ({"text_input": "hi", "max_tokens": 4, "timeout": -5}, "timeout: must be an integer >= 0"),
    ({"text_input": "hi", "max_tokens": 4, "timeout": "soon"}, "timeout: must be an integer >= 0"),
    ({"text_input": "hi", "input_ids": [1, 2], "max_tokens": 4}, "input_ids: a request carries text_input or"),
    ({"input_ids": [1, 10**6], "max_tokens": 4}, "input_ids: token ids must be integers in"),
    ({"text_input": "hi", "max_tokens": 4, "logprobs": 21}, "logprobs: must be <= 20"),
    ({"text_input": "hi", "max_tokens": 4, "guided_decoding_guide_type": "regex", "guided_decoding_guide": "a(b"},
     "guided_decoding_guide: does not compile"),
])
def test_malformed_request_names_field(server, name, body, field):
    r = requests.post(f"http://{server.http_url}/v2/models/{name}/generate", json=body, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text)
    assert field in r.json()["error"]


PROMPTS = [
    "The history of the city", "Numbers: one two three", "A recipe for bread", "Dear diary, today",
    "In the beginning", "Weather report:", "Questions and answers", "The last line",
]


def _generate(server, model, prompt, max_tokens, infer=False):
    """Over /generate, or over HTTP /infer (models that are not decoupled)."""
    client = LLMClient(server.http_url, server.grpc_url, timeout=300)
    try:
        ask = client.infer_http if infer else client.generate
        return ask(model, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True).text
    finally:
        client.close()


@pytest.fixture(scope="module")
def engine():
    """The engine in this process, on the checkpoint the server loads: what each request gives alone."""
    return LLMEngine(ROOT / "models" / "tiny-random", EngineConfig(num_threads=1))


@pytest.fixture(scope="module")
def uncached_engine():
    """The same engine with prefix caching off: what a request gets with no cache at all."""
    return LLMEngine(ROOT / "models" / "tiny-random", EngineConfig(num_threads=1, enable_prefix_caching=False))


_ALONE: dict = {}  # (prompt, params) -> output: each model's test asks for the same references


def _alone(engine, params: list[SamplingParams]) -> list:
    """Each of PROMPTS run alone in process with its params: the output every model must match."""
    for p, sp in zip(PROMPTS, params):
        if (p, sp) not in _ALONE:
            _ALONE[(p, sp)] = engine.generate([p], sp)[0]
    return [_ALONE[(p, sp)] for p, sp in zip(PROMPTS, params)]


def _ask(server, model, protocol, prompt, max_tokens, **options):
    """One whole answer over `protocol`, or the RequestFailed it ended with."""
    client = LLMClient(server.http_url, server.grpc_url, timeout=300)
    try:
        return client.answer(protocol, model, prompt, max_tokens, **options)
    except RequestFailed as exc:
        return exc
    finally:
        client.close()


def _protocols(model):
    """Every way of asking `model` for one answer: HTTP /infer cannot serve the decoupled one."""
    return STREAMING_PROTOCOLS if model == "continuous_batching" else PROTOCOLS


def test_greedy_text_is_the_same_everywhere(server, engine):
    lengths = [6 + 5 * i for i in range(len(PROMPTS))]  # different lengths share each batch
    alone = [out.text for out in _alone(engine, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])]
    for model in MODELS:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            # static and dynamic batching also answer /infer: every other request of a batch goes there
            infer = [i % 2 == 1 and model != "continuous_batching" for i in range(len(PROMPTS))]
            texts = list(pool.map(lambda a: _generate(server, model, *a), zip(PROMPTS, lengths, infer)))
        assert texts == alone, model


# The code each protocol carries for INVALID_ARG: /generate answers every model error with 400, and a
# gRPC stream (how the decoupled model answers over gRPC) carries the message alone (docs/operations.md,
# "Status codes, per endpoint")
INVALID_ARG = {"http": "400", "infer": "400", "grpc": "StatusCode.INVALID_ARGUMENT", "grpc stream": "grpc"}
BAD_OPTIONS = [("max_tokens", 0, {}), ("temperature", 4, {"temperature": -1.0}), ("top_p", 4, {"top_p": 2.0})]


@pytest.mark.parametrize("model", MODELS)
def test_bad_requests_in_a_burst_are_refused_and_harm_no_other(server, engine, model):
    """Bad requests sent amid a full batch of good ones, over every protocol the model serves: each bad
    one is refused INVALID_ARG naming its field, and every good one gets the text it gets alone (in
    dynamic batching the bad ones arrive inside the batches Triton forms; static batching still fills
    its batch of 8 from the good ones)."""
    lengths = [5 + 2 * i for i in range(len(PROMPTS))]
    alone = [out.text for out in _alone(engine, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])]
    protocols = _protocols(model)
    bad = [(protocol, field, max_tokens, options) for protocol in protocols
           for field, max_tokens, options in BAD_OPTIONS]
    with ThreadPoolExecutor(len(PROMPTS) + len(bad)) as pool:
        good, refused = [], []
        for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):  # the bad ones interleaved with the good
            good.append(pool.submit(_ask, server, model, protocols[i % len(protocols)], prompt, n, ignore_eos=True))
            for protocol, field, max_tokens, options in bad[i::len(PROMPTS)]:
                refused.append((protocol, field, pool.submit(_ask, server, model, protocol, "Bad", max_tokens,
                                                             **options)))
        answers = [f.result(timeout=300) for f in good]
        for protocol, field, future in refused:
            error = future.result(timeout=300)
            assert isinstance(error, RequestFailed), (protocol, field, error)
            code = INVALID_ARG["grpc stream" if protocol == "grpc" and model == "continuous_batching" else protocol]
            assert error.status == code and field in error.message, (protocol, field, error)
    assert [a.text if not isinstance(a, Exception) else a for a in answers] == alone
    assert [a.num_output_tokens for a in answers] == lengths


@pytest.mark.parametrize("model", MODELS)
def test_seeded_sampling_is_the_same_everywhere(server, engine, model):
    """temperature, top_k, top_p and seed reach the engine through Triton: each seeded request samples
    the text it samples alone in process, whatever shares its batch (a dropped option would give the
    greedy text, or another sample)."""
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    alone = [out.text for out in _alone(engine, params)]
    greedy = [out.text for out in _alone(engine, [SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True)
                                                  for sp in params])]
    assert sum(a != g for a, g in zip(alone, greedy)) >= len(PROMPTS) // 2  # sampling makes a difference
    protocols = _protocols(model)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(
            lambda i: _ask(server, model, protocols[i % len(protocols)], PROMPTS[i], params[i].max_tokens,
                           temperature=params[i].temperature, top_k=params[i].top_k, top_p=params[i].top_p,
                           seed=params[i].seed, ignore_eos=True), range(len(PROMPTS))))
    assert [a.text if not isinstance(a, Exception) else a for a in answers] == alone


@pytest.mark.parametrize("model", MODELS)
def test_a_stop_string_ends_the_text_everywhere(server, engine, model):
    """A stop string ends the text before it, with finish reason "stop", as in process; the continuous
    model's streams carry the same text in pieces and end with "stop" too."""
    full = _alone(engine, [SamplingParams(max_tokens=30, ignore_eos=True)] * len(PROMPTS))
    stops = [out.text[len(out.text) // 2: len(out.text) // 2 + 3] for out in full]
    params = [SamplingParams(max_tokens=30, stop=(stop,), ignore_eos=True) for stop in stops]
    expected = _alone(engine, params)
    assert all(out.finish_reason.value == "stop" and len(out.text) < len(f.text) for out, f in zip(expected, full))
    protocols = _protocols(model)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda i: _ask(server, model, protocols[i % len(protocols)], PROMPTS[i], 30,
                                               stop=[stops[i]], ignore_eos=True), range(len(PROMPTS))))
    assert [(a.text, a.finish_reason) if not isinstance(a, Exception) else a for a in answers] == \
        [(out.text, "stop") for out in expected]
    assert [a.num_output_tokens for a in answers] == [out.num_output_tokens for out in expected]
    if model == "continuous_batching":
        def streamed(i):
            client = LLMClient(server.http_url, server.grpc_url, timeout=300)
            try:
                chunks = list(client.stream(protocols[i % 2], model, PROMPTS[i], 30, stop=[stops[i]],
                                            ignore_eos=True, stream=True))
            finally:
                client.close()
            return collect(iter(chunks)).text, chunks[-1].finish_reason, len(chunks)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(streamed, range(len(PROMPTS))))
        assert [(text, reason) for text, reason, _ in results] == [(out.text, "stop") for out in expected]
        assert sum(n for _, _, n in results) > len(PROMPTS)  # in pieces


@pytest.mark.parametrize("model", MODELS)
def test_log_probabilities_are_the_same_everywhere(server, engine, model):
    """`logprobs` and `prompt_logprobs` reach the engine through Triton, and its outputs come back over
    every protocol the model serves (and in the continuous model's streams, in pieces): the ids, values and
    alternatives the request gets alone in process, next to requests that ask for none."""
    params = [SamplingParams(max_tokens=5 + i, ignore_eos=True, **({"logprobs": 2, "prompt_logprobs": 1}
                                                                    if i % 2 == 0 else {}))
              for i in range(len(PROMPTS))]
    alone = _alone(engine, params)
    protocols = _protocols(model)

    def ask(i):
        options = {k: getattr(params[i], k) for k in ("logprobs", "prompt_logprobs")
                   if getattr(params[i], k) is not None}
        if model != "continuous_batching" or i % 4 != 0:
            return _ask(server, model, protocols[i % len(protocols)], PROMPTS[i], params[i].max_tokens,
                        ignore_eos=True, **options)
        client = LLMClient(server.http_url, server.grpc_url, timeout=300)
        try:
            return collect(client.stream(protocols[i // 4 % 2], model, PROMPTS[i], params[i].max_tokens,
                                         ignore_eos=True, stream=True, **options))
        finally:
            client.close()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, range(len(PROMPTS))))
    for i, (answer, out) in enumerate(zip(answers, alone)):
        assert not isinstance(answer, Exception), (i, answer)
        assert (answer.text, answer.token_ids) == (out.text, out.token_ids), i
        if i % 2:
            assert (answer.logprobs, answer.prompt_ids, answer.prompt_logprobs) == (None, None, None), i
            continue
        assert answer.prompt_ids == out.prompt_ids, i
        for got, want in zip((answer.logprobs, answer.prompt_logprobs), (out.logprobs, out.prompt_logprobs)):
            ids = [[(t.token_id, [a for a, _ in t.top]) for t in side] for side in (got, want)]
            assert ids[0] == ids[1], i
            assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-5), i


@pytest.mark.parametrize("model", MODELS)
def test_a_prompt_of_token_ids_is_the_same_prompt(server, engine, model):
    """`input_ids` in place of `text_input`, over every protocol the model serves: the text and ids the
    text prompt gets."""
    params = [SamplingParams(max_tokens=4 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    alone = _alone(engine, params)
    protocols = _protocols(model)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda i: _ask(server, model, protocols[i % len(protocols)],
                                               engine.tokenizer.encode(PROMPTS[i]), params[i].max_tokens,
                                               ignore_eos=True), range(len(PROMPTS))))
    assert [a if isinstance(a, Exception) else (a.text, a.token_ids) for a in answers] == \
        [(out.text, out.token_ids) for out in alone]


@pytest.mark.parametrize("model", MODELS)
def test_penalties_bias_and_min_tokens_reach_the_engine_everywhere(server, engine, model):
    """min_tokens, the three penalties and logit_bias reach the engine through Triton: each request gets
    what it gets alone in process, next to requests that use none. Each penalty changes the tokens that
    its logit_bias alone gives (the bias makes token 9 repeat, the penalty holds it back), and EOS, made
    the likeliest token, ends the text as soon as min_tokens allows."""
    eos, bias = min(engine.tokenizer.eos_token_ids), {9: 16.0}
    options = [dict(logit_bias=bias, repetition_penalty=1.4), dict(logit_bias={eos: 100.0}, min_tokens=3), {},
               dict(logit_bias=bias, frequency_penalty=2.0), dict(logit_bias=bias, presence_penalty=2.0),
               dict(logit_bias={eos: 100.0}, min_tokens=5), {}, dict(logit_bias={7: 50.0, 8: -5.0})]
    params = [SamplingParams(max_tokens=8 + i, ignore_eos=i % 4 != 1, **o) for i, o in enumerate(options)]
    alone = _alone(engine, params)
    assert [len(alone[i].token_ids) for i in (1, 5)] == [4, 6]
    biased = _alone(engine, [SamplingParams(max_tokens=params[i].max_tokens, ignore_eos=True, logit_bias=bias)
                             for i in range(len(PROMPTS))])
    assert all(alone[i].token_ids != biased[i].token_ids for i in (0, 3, 4))
    protocols = _protocols(model)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda i: _ask(server, model, protocols[i % len(protocols)], PROMPTS[i],
                                               params[i].max_tokens, ignore_eos=params[i].ignore_eos,
                                               **options[i]), range(len(PROMPTS))))
    assert [a if isinstance(a, Exception) else (a.token_ids, a.finish_reason) for a in answers] == \
        [(out.token_ids, out.finish_reason.value) for out in alone]


@pytest.mark.parametrize("model", MODELS)
def test_a_repeated_prefix_comes_from_the_cache_with_the_same_answer(server, engine, uncached_engine, model):
    """Prefix caching is on in every model: once a batch of requests has run, a second batch whose prompts
    share their beginning says how many prompt tokens came from the cache (every full block of the shared
    part), gets the answers it gets alone with no cache, and the prefix-cache metrics count the hits."""
    prefix = " ".join(PROMPTS) * 3 + f" ({model})"  # no other test sends it to this server
    first = [f"{prefix} {p}" for p in PROMPTS]
    second = [f"{prefix} {p} again" for p in reversed(PROMPTS)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    expected = uncached_engine.generate(second, params)
    common = len(engine.tokenizer.encode(prefix)) // 16 * 16
    hits_before = metric_value(server, "batchlm_prefix_cache_hits_total", model) or 0
    protocols = _protocols(model)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        for prompts in (first, second):
            answers = list(pool.map(lambda i: _ask(server, model, protocols[i % len(protocols)], prompts[i], 6,
                                                   ignore_eos=True, logprobs=1), range(len(PROMPTS))))
    assert [a if isinstance(a, Exception) else a.num_cached_tokens for a in answers] == [common] * len(PROMPTS)
    assert [(a.token_ids, [t.logprob for t in a.logprobs]) for a in answers] == \
        [(out.token_ids, [t.logprob for t in out.logprobs]) for out in expected]
    hits = hits_before + len(PROMPTS) * common  # at least: the first batch's later arrivals may hit too
    deadline = time.monotonic() + 5
    while (seen := metric_value(server, "batchlm_prefix_cache_hits_total", model) or 0) < hits:
        assert time.monotonic() < deadline, (seen, hits)
        time.sleep(0.05)


@pytest.mark.parametrize("model", MODELS)
def test_guided_requests_follow_their_guide_everywhere(server, engine, model):
    """guided_decoding_guide_type and guided_decoding_guide reach the engine through Triton: a guided
    request's text matches its regular expression, and every request, guided or not, gets what it gets
    alone in process."""
    guide = "(yes|no): [0-9]{2,4}"
    options = [dict(guided_decoding_guide_type="regex", guided_decoding_guide=guide) if i % 2 == 0 else {}
               for i in range(len(PROMPTS))]
    params = [SamplingParams(max_tokens=16, **o) for o in options]
    alone = _alone(engine, params)
    protocols = _protocols(model)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda i: _ask(server, model, protocols[i % len(protocols)], PROMPTS[i], 16,
                                               **options[i]), range(len(PROMPTS))))
    assert [a if isinstance(a, Exception) else a.text for a in answers] == [out.text for out in alone]
    assert all(re.fullmatch(guide, a.text) for a in answers[::2])
