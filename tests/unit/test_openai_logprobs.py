"""The OpenAI frontend's log-probabilities, with no server: `logprobs`, `top_logprobs` and `echo` mapped
onto the schema, and the models' Chunks shaped into OpenAI's two `logprobs` objects, whole and streamed,
with the tiny checkpoint's tokenizer giving each token's text and bytes."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from batchlm.frontend.errors import ApiError
from batchlm.frontend.logprobs import ChoiceShaper
from batchlm.frontend.protocol import ChatCompletionRequest, CompletionRequest
from batchlm.frontend.responses import Choice, Envelope, Usage
from batchlm.frontend.schema_request import chat_request, completion_request
from batchlm.frontend.token_text import TokenTexts
from batchlm.frontend.tokenize import load_tokenizer
from batchlm.frontend.validation import validation_error
from batchlm.paths import TINY_MODEL_DIR
from batchlm.response_schema import Chunk, MalformedResponse, TokenLogprob
from tests.unit.openai_app import FakeBackend, events, post

# The tiny checkpoint's ids: BOS, "H" "ell" "o" (the prompt "Hello"), " world", and " 日本" as byte-level
# BPE splits it: b" \xe6", b"\x97\xa5\xe6", b"\x9c", b"\xac" (each character's bytes over two tokens)
BOS, H, ELL, O_, WORLD = 1, 42, 516, 81, 1844
JA = (677, 948, 253, 108)
PROMPT, PROMPT_IDS = "Hello", (BOS, H, ELL, O_)


@pytest.fixture(scope="module")
def texts() -> TokenTexts:
    return TokenTexts(load_tokenizer("m", TINY_MODEL_DIR))


def completion(**body) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": PROMPT, **body}))


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}))


def scored(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id, logprob, tuple(top))


def chunk(text: str, ids: tuple[int, ...], logprobs=None, finish: str = "", **prompt) -> Chunk:
    if logprobs is None:
        logprobs = tuple(scored(i, -0.5 - n, (i, -0.5 - n)) for n, i in enumerate(ids))
    return Chunk(text, finish, len(PROMPT_IDS), len(ids), token_ids=ids, logprobs=logprobs, **prompt)


PROMPT_SCORES = (scored(H, -6.0, (WORLD, -1.0), (H, -6.0)), scored(ELL, -2.5, (ELL, -2.5), (O_, -3.0)),
                 scored(O_, -0.25, (O_, -0.25), (H, -4.0)))


# -- the request -------------------------------------------------------------------------------------

def test_completion_logprobs_and_echo_ask_for_the_schemas_logprobs_and_prompt_logprobs():
    plain = completion_request(completion(logprobs=3))
    assert plain.fields["logprobs"] == 3 and "prompt_logprobs" not in plain.fields and plain.logprobs == 3
    echoed = completion_request(completion(logprobs=1, echo=True, max_tokens=1))
    assert (echoed.fields["logprobs"], echoed.fields["prompt_logprobs"], echoed.echo) == (1, 1, True)
    assert echoed.params["prompt_logprobs"] == "logprobs"   # a model's refusal of it names the parameter sent
    assert completion_request(completion(echo=True)).fields.keys() == completion_request(completion()).fields.keys()
    assert completion_request(completion(logprobs=None)).logprobs is None


def test_echo_with_max_tokens_0_asks_for_one_token_and_leaves_it_out():
    scoring = completion_request(completion(echo=True, logprobs=1, max_tokens=0))
    assert scoring.fields["max_tokens"] == 1 and not scoring.keep_output
    assert completion_request(completion(max_tokens=0)).fields["max_tokens"] == 0  # the model refuses it


def test_chat_logprobs_asks_for_top_logprobs_alternatives():
    assert chat_request(chat(logprobs=True, top_logprobs=3), "P").fields["logprobs"] == 3
    only = chat_request(chat(logprobs=True), "P")
    assert only.fields["logprobs"] == 0 and only.logprobs == 0 and only.params["logprobs"] == "logprobs"
    assert chat_request(chat(logprobs=True, top_logprobs=2), "P").params["logprobs"] == "top_logprobs"
    assert "logprobs" not in chat_request(chat(logprobs=False, top_logprobs=0), "P").fields


@pytest.mark.parametrize("make, body, param", [
    (completion, {"logprobs": 21}, "logprobs"),
    (completion, {"logprobs": -1}, "logprobs"),
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (chat, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (chat, {"top_logprobs": 2}, "top_logprobs"),                       # without logprobs: true
    (chat, {"logprobs": False, "top_logprobs": 5}, "top_logprobs"),
])
def test_a_count_of_alternatives_out_of_range_or_without_logprobs_is_a_400_naming_it(make, body, param):
    with pytest.raises(ApiError) as refused:
        (completion_request if make is completion else lambda b: chat_request(b, "P"))(make(**body))
    assert (refused.value.status, refused.value.param) == (400, param)
    assert refused.value.message.startswith(f"{param}: ")


@pytest.mark.parametrize("body, param", [({"logprobs": True}, "logprobs"), ({"prompt": [1, "a"]}, "prompt")])
def test_a_boolean_logprobs_or_a_prompt_of_ids_and_text_is_refused_by_the_completions_body(body, param):
    with pytest.raises(ValidationError) as refused:
        completion(**body)
    assert validation_error(refused.value.errors(include_url=False)).param == param


# -- completions -------------------------------------------------------------------------------------

def test_a_completions_logprobs_hold_the_top_n_and_the_chosen_token_with_text_offsets(texts):
    schema = completion_request(completion(logprobs=2))
    answer = chunk(" world 日本", (WORLD, *JA), logprobs=(
        scored(WORLD, -1.0, (WORLD, -1.0), (H, -2.0)),       # the chosen token is the most likely
        scored(JA[0], -3.0, (WORLD, -0.5), (O_, -1.5)),        # ... or is not among the top 2
        *(scored(i, -0.125, (i, -0.125), (O_, -9.0)) for i in JA[1:])), finish="length")
    piece = ChoiceShaper(schema, chat=False, texts=texts).piece(answer)
    logprobs = piece.logprobs
    assert piece.text == " world 日本" and piece.tokens == 5
    assert logprobs["tokens"] == [" world", " \ufffd", "\ufffd\ufffd\ufffd", "\ufffd", "\ufffd"]
    assert logprobs["token_logprobs"] == [-1.0, -3.0, -0.125, -0.125, -0.125]
    assert logprobs["top_logprobs"][0] == {" world": -1.0, "H": -2.0}
    assert list(logprobs["top_logprobs"][1].items()) == [(" world", -0.5), ("o", -1.5), (" \ufffd", -3.0)]
    # a token that starts a character shares its offset with the one that finishes it
    assert logprobs["text_offset"] == [0, 6, 7, 8, 8]
    body = Envelope("cmpl-1", False, 5, "m").body([Choice(piece.text, "length", logprobs)], Usage(4, 5))
    assert Completion.model_validate(body).choices[0].logprobs.tokens == logprobs["tokens"]


def test_logprobs_0_shows_the_chosen_token_alone_and_no_logprobs_shows_null(texts):
    answer = chunk(" world", (WORLD,), logprobs=(scored(WORLD, -0.75),), finish="length")
    zero = ChoiceShaper(completion_request(completion(logprobs=0)), False, texts).piece(answer).logprobs
    assert zero["top_logprobs"] == [{" world": -0.75}]
    none = ChoiceShaper(completion_request(completion()), False, None).piece(answer)
    assert none.logprobs is None and none.text == " world"
    assert Envelope("c", False, 5, "m").body([Choice(none.text, "length")], None)["choices"][0]["logprobs"] is None


def test_echo_puts_the_prompt_first_its_first_token_unscored(texts):
    schema = completion_request(completion(logprobs=1, echo=True, max_tokens=1))
    answer = chunk(" world", (WORLD,), finish="length", prompt_ids=PROMPT_IDS, prompt_logprobs=PROMPT_SCORES)
    piece = ChoiceShaper(schema, chat=False, texts=texts).piece(answer)
    logprobs = piece.logprobs
    assert piece.text == "Hello world"
    assert logprobs["tokens"] == ["<s>", "H", "ell", "o", " world"]
    assert logprobs["token_logprobs"] == [None, -6.0, -2.5, -0.25, -0.5]
    assert logprobs["top_logprobs"][:2] == [None, {" world": -1.0, "H": -6.0}]
    assert logprobs["text_offset"] == [0, 0, 1, 4, 5]   # BOS is no text; the answer starts after the prompt
    # what lm-evaluation-harness' local-completions reads of it: the continuation "ell" "o" after "H"
    ctxlen, continuation = 2, slice(2, -1)
    assert ctxlen > 0 and sum(logprobs["token_logprobs"][continuation]) == -2.75
    assert all(lp == max(top.values()) for lp, top in zip(logprobs["token_logprobs"][continuation],
                                                          logprobs["top_logprobs"][continuation]))


def test_echo_with_max_tokens_0_answers_the_prompt_alone(texts):
    schema = completion_request(completion(logprobs=0, echo=True, max_tokens=0))
    answer = chunk(" world", (WORLD,), finish="length", prompt_ids=PROMPT_IDS, prompt_logprobs=PROMPT_SCORES)
    piece = ChoiceShaper(schema, chat=False, texts=texts).piece(answer)
    assert piece.text == PROMPT and piece.logprobs["tokens"] == ["<s>", "H", "ell", "o"]
    no_logprobs = ChoiceShaper(completion_request(completion(echo=True, max_tokens=0)), False, None).piece(answer)
    assert no_logprobs.text == PROMPT and no_logprobs.logprobs is None


def test_a_stream_carries_each_chunks_tokens_and_offsets_run_on(texts):
    """The engine holds text back while a character is unfinished: a chunk may carry a token and no text."""
    schema = completion_request(completion(logprobs=1, echo=True, stream=True))
    shaper = ChoiceShaper(schema, chat=False, texts=texts)
    chunks = [chunk(" world", (WORLD,), prompt_ids=PROMPT_IDS, prompt_logprobs=PROMPT_SCORES),
              chunk(" ", JA[:1]), chunk("日", JA[1:2]), chunk("", JA[2:3]), chunk("本", JA[3:], finish="length"),
              chunk("", ())]
    pieces = [shaper.piece(c) for c in chunks]
    assert [p.text for p in pieces] == ["Hello world", " ", "日", "", "本", ""]
    assert [bool(p) for p in pieces] == [True, True, True, True, True, False]   # the last has nothing to send
    assert pieces[0].logprobs["tokens"] == ["<s>", "H", "ell", "o", " world"]
    assert [p.logprobs["text_offset"] for p in pieces[1:]] == [[11], [12], [13], [13], []]


# -- chat --------------------------------------------------------------------------------------------

def test_chat_logprobs_carry_exact_bytes_and_the_top_alternatives(texts):
    schema = chat_request(chat(logprobs=True, top_logprobs=2), "P")
    answer = chunk(" 日", JA[:2], logprobs=(scored(JA[0], -0.5, (JA[0], -0.5), (WORLD, -1.0)),
                                            scored(JA[1], float("-inf"), (O_, -0.1), (H, -0.2))), finish="length")
    piece = ChoiceShaper(schema, chat=True, texts=texts).piece(answer)
    content = piece.logprobs["content"]
    assert piece.logprobs["refusal"] is None and len(content) == 2
    assert content[0] == {"token": " \ufffd", "logprob": -0.5, "bytes": [32, 0xE6], "top_logprobs": [
        {"token": " \ufffd", "logprob": -0.5, "bytes": [32, 0xE6]},
        {"token": " world", "logprob": -1.0, "bytes": list(b" world")}]}
    assert content[1]["logprob"] == -9999.0 and content[1]["bytes"] == [0x97, 0xA5, 0xE6]
    assert bytes(content[0]["bytes"] + content[1]["bytes"][:2]).decode() == " 日"
    body = Envelope("chatcmpl-1", True, 5, "m").body([Choice(piece.text, "length", piece.logprobs)], Usage(4, 2))
    json.dumps(body, allow_nan=False)
    parsed = ChatCompletion.model_validate(body).choices[0].logprobs.content
    assert [t.top_logprobs[1].token for t in parsed] == [" world", "H"]


def test_chat_logprobs_without_top_logprobs_have_empty_alternatives_and_stream_per_chunk(texts):
    shaper = ChoiceShaper(chat_request(chat(logprobs=True, stream=True), "P"), chat=True, texts=texts)
    pieces = [shaper.piece(c) for c in (chunk(" ", JA[:1], logprobs=(scored(JA[0], -0.5),)),
                                        chunk("", JA[1:2], logprobs=(scored(JA[1], -0.25),)))]
    assert [[t["top_logprobs"] for t in p.logprobs["content"]] for p in pieces] == [[[]], [[]]]
    event = Envelope("chatcmpl-1", True, 5, "m").chunk(pieces[1].text, logprobs=pieces[1].logprobs)
    parsed = ChatCompletionChunk.model_validate(event).choices[0]
    assert parsed.delta.content == "" and parsed.logprobs.content[0].bytes == [0x97, 0xA5, 0xE6]


# -- what the models send ----------------------------------------------------------------------------

def test_tokens_without_their_logprobs_are_a_malformed_response(texts):
    shaper = ChoiceShaper(chat_request(chat(logprobs=True), "P"), chat=True, texts=texts)
    with pytest.raises(MalformedResponse, match="output_log_probs"):
        shaper.piece(Chunk(" world", "length", 4, 1, token_ids=(WORLD,)))
    assert shaper.piece(Chunk("", "length", 4, 1, token_ids=())).tokens == 0   # a last response with nothing
    echo = ChoiceShaper(completion_request(completion(logprobs=0, echo=True)), chat=False, texts=texts)
    with pytest.raises(MalformedResponse, match="prompt_log_probs"):
        echo.piece(chunk(" world", (WORLD,)))


def test_a_decoupled_models_chunks_join_into_one_answer():
    first = chunk(" world", (WORLD,), prompt_ids=PROMPT_IDS, prompt_logprobs=PROMPT_SCORES)
    whole = Chunk.joined([first, chunk(" ", JA[:1]), chunk("", (), logprobs=(), finish="length")])
    assert (whole.text, whole.token_ids, whole.finish_reason) == (" world ", (WORLD, JA[0]), "length")
    assert [t.token_id for t in whole.logprobs] == [WORLD, JA[0]] and whole.prompt_logprobs == PROMPT_SCORES
    unscored = Chunk.joined([first, Chunk(" ", "length", 4, 2, token_ids=JA[:1])])
    assert unscored.logprobs is None and unscored.token_ids == (WORLD, JA[0])
    plain = Chunk.joined([Chunk("a", "", 4, 1), Chunk("b", "stop", 4, 2)])
    assert (plain.text, plain.token_ids, plain.logprobs, plain.prompt_ids) == ("ab", None, None, None)


# -- through the app, with a stand-in for Triton -----------------------------------------------------

def _sent(backend: FakeBackend) -> dict[str, int]:
    return {name: value for name, value in backend.sent[-1].items() if isinstance(value, int)}


SCORING = [chunk(" world", (WORLD,), finish="length", prompt_ids=PROMPT_IDS, prompt_logprobs=PROMPT_SCORES)]


@pytest.mark.parametrize("model", ["continuous_batching", "dynamic_batching"])
def test_lm_evaluation_harness_scoring_request_is_answered_as_it_reads_it(model):
    """local-completions' loglikelihood payload: echo, logprobs 1, max_tokens 1, temperature 0."""
    backend = FakeBackend(SCORING)
    status, content = post(backend, "/v1/completions", {"model": model, "prompt": PROMPT, "temperature": 0,
                                                         "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert status == 200, content
    assert _sent(backend) == {"max_tokens": 1, "logprobs": 1, "prompt_logprobs": 1, "seed": 1234}
    choice = json.loads(content)["choices"][0]
    assert choice["text"] == "Hello world" and choice["logprobs"]["token_logprobs"][0] is None
    assert sum(choice["logprobs"]["token_logprobs"][2:-1]) == -2.75


def test_echo_with_max_tokens_0_counts_no_completion_token():
    backend = FakeBackend(SCORING)
    status, content = post(backend, "/v1/completions", {"model": "continuous_batching", "prompt": PROMPT,
                                                         "max_tokens": 0, "logprobs": 0, "echo": True})
    answer = json.loads(content)
    assert status == 200 and answer["choices"][0]["text"] == PROMPT and _sent(backend)["max_tokens"] == 1
    assert len(answer["choices"][0]["logprobs"]["tokens"]) == 4 and answer["usage"]["completion_tokens"] == 0


def test_a_streamed_chat_carries_each_tokens_logprobs_also_without_text():
    backend = FakeBackend([chunk(" ", JA[:1]), chunk("", JA[1:2]), chunk("日", (), logprobs=()),
                        chunk("", (), logprobs=(), finish="length")])
    status, content = post(backend, "/v1/chat/completions", {
        "model": "continuous_batching", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "logprobs": True, "top_logprobs": 1, "stream": True})
    assert status == 200 and _sent(backend)["logprobs"] == 1
    chunks = [ChatCompletionChunk.model_validate(e).choices[0] for e in events(content)]
    assert [(c.delta.content, c.logprobs and len(c.logprobs.content)) for c in chunks] == [
        ("", None), (" ", 1), ("", 1), ("日", 0), (None, None)]
    assert chunks[-1].finish_reason == "length"


def test_a_model_that_sends_tokens_without_logprobs_is_a_500():
    backend = FakeBackend([Chunk(" world", "length", 4, 1, token_ids=(WORLD,))])
    status, content = post(backend, "/v1/completions", {"model": "dynamic_batching", "prompt": PROMPT,
                                                         "logprobs": 2})
    assert status == 500 and "output_log_probs" in json.loads(content)["error"]["message"]
