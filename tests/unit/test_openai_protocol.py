"""The OpenAI frontend's pure translation, with no server: request mapping onto the shared schema,
Triton's errors onto OpenAI's, refused bodies onto a 400 naming the parameter, chunk shapes, chat
templates, and the input tensors each model's config asks for."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from batchlm.frontend import errors
from batchlm.frontend.__main__ import parse_args
from batchlm.model.chat_template import ChatTemplate, load_chat_template, plain_prompt
from batchlm.paths import MODEL_ENV, TINY_MODEL_DIR
from batchlm.errors import InvalidArgument
from batchlm.frontend.errors import ApiError
from batchlm.launcher.frontend_process import FrontendProcess
from batchlm.frontend.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, template_messages
from batchlm.frontend.responses import DONE, Choice, Envelope, Usage, finish_reason_of, sse
from batchlm.frontend.schema_request import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    chat_request,
    completion_request,
)
from batchlm.frontend.tokenize import detokenize, load_tokenizer, tokenize
from batchlm.frontend.triton_client import ModelInfo, infer_inputs
from batchlm.frontend.validation import param_of, validation_error
from batchlm.model.checkpoint import DEFAULT_CHAT_TEMPLATE

INPUTS = ("text_input", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos", "stream")


def completion(**body) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "hi", **body}))


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}))


def test_openai_parameters_map_one_to_one_onto_the_schema():
    request = completion_request(completion(max_tokens=8, temperature=0.5, top_p=0.9, seed=7, stop="END",
                                            top_k=40, ignore_eos=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert request.fields == {"text_input": "hi", "max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "seed": 7,
                              "stop": ["END"], "top_k": 40, "ignore_eos": True}
    assert request.params == {"text_input": "prompt", "input_ids": "prompt", "max_tokens": "max_tokens",
                              "logit_bias_ids": "logit_bias"}
    assert request.stream and request.include_usage


def test_left_out_parameters_are_left_out_except_max_tokens_and_temperature():
    assert completion_request(completion()).fields == {"text_input": "hi", "max_tokens": DEFAULT_COMPLETION_MAX_TOKENS,
                                                       "temperature": 1.0}  # OpenAI's default
    assert chat_request(chat(), "P").fields == {"text_input": "P", "max_tokens": DEFAULT_CHAT_MAX_TOKENS,
                                                "temperature": 1.0}
    assert chat_request(chat(temperature=0.0), "P").fields["temperature"] == 0.0  # greedy, one parameter away
    assert chat_request(chat(), "P", default_max_tokens=900).fields["max_tokens"] == 900  # the rest of the context
    assert chat_request(chat(max_tokens=7), "P", default_max_tokens=900).fields["max_tokens"] == 7
    assert completion_request(completion(stop=["a", "b"], prompt=["one"])).fields["stop"] == ["a", "b"]


def test_max_completion_tokens_is_chats_max_tokens_and_errors_name_it():
    request = chat_request(chat(max_completion_tokens=5), "P")
    assert request.fields["max_tokens"] == 5 and request.params["max_tokens"] == "max_completion_tokens"
    assert request.params["text_input"] == "messages"
    with pytest.raises(ApiError, match="^max_completion_tokens: differs from max_tokens"):
        chat_request(chat(max_completion_tokens=5, max_tokens=6), "P")


@pytest.mark.parametrize("body, param", [
    ({"n": 9}, "n"),
    ({"n": 0}, "n"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": ["a"] * 129}, "prompt"),
    ({"prompt": ["a"] * 17, "n": 8}, "n"),
    ({"prompt": [2**31]}, "prompt"),               # an id its input's type cannot hold
    ({"seed": -1}, "seed"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),         # the second choice's seed would not fit
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1_0": 1}}, "logit_bias"),
    ({"logit_bias": {str(2**40): 1}}, "logit_bias"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),   # without stream: true
    ({"logprobs": 21}, "logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"best_of": 2, "n": 3}, "best_of"),
    ({"suffix": "x"}, "suffix"),
])
def test_what_the_models_cannot_do_is_a_400_naming_the_parameter(body, param):
    with pytest.raises(ApiError) as refused:
        completion_request(completion(**body))
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.message.startswith(f"{param}: ")


def test_neutral_values_of_unsupported_parameters_are_accepted():
    completion_request(completion(n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, echo=False,
                                  best_of=1, logprobs=None, user="someone", suffix=""))
    assert completion_request(completion(n=3, best_of=3)).n == 3
    chat_request(chat(logprobs=False, top_logprobs=0, response_format={"type": "text"}, tools=[],
                      tool_choice="none"), "P")


@pytest.mark.parametrize("body, param, reason", [
    ({"temprature": 1}, "temprature", "unknown parameter"),
    ({"max_tokens": "8"}, "max_tokens", "valid integer"),      # strict: no string to number
    ({"stream": 1}, "stream", "valid boolean"),
    ({"stop": 5}, "stop", "valid string; or Input should be a valid array"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "valid string"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'system'"),
    ({"messages": []}, "messages", "at least 1"),
    ({"model": None}, "model", "valid string"),
])
def test_a_refused_body_is_a_400_naming_the_parameter(body, param, reason):
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate_json(
            json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}))
    error = validation_error(refused.value.errors(include_url=False))
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(f"{param}: ") and reason in error.message


def test_a_body_that_is_not_json_or_not_an_object_names_no_parameter():
    assert param_of(("body",)) is None
    error = validation_error([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"}])
    assert error.param is None and "not valid JSON" in error.message


@pytest.mark.parametrize("status, message, code, param", [
    # a model's INVALID_ARG starts with the schema field; the 400 names the OpenAI parameter
    ("StatusCode.INVALID_ARGUMENT", "max_tokens: must be >= 1, got 0", 400, "max_tokens"),
    (None, "text_input: must not be empty", 400, "prompt"),  # a stream carries the message only
    (None, "stop: at most 16 stop strings", 400, "stop"),
    # overload: the models' UNAVAILABLE, on ModelInfer and on a stream; dynamic_batching's full queue
    ("StatusCode.UNAVAILABLE", "static_batching is overloaded: 64 requests already waiting", 429, None),
    (None, "continuous_batching is overloaded: 256 requests already waiting", 429, None),
    ("StatusCode.UNAVAILABLE", "Exceeds maximum queue size", 429, None),
    ("StatusCode.UNAVAILABLE", "continuous_batching is unloading; retry later", 503, None),
    (None, "continuous_batching was unloaded before the request finished", 503, None),
    ("StatusCode.UNAVAILABLE", "failed to connect to all addresses", 503, None),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'x' is not found", 404, "model"),
    ("StatusCode.INTERNAL", "RuntimeError: the step failed", 500, None),
    ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", 504, None),
    # a message that merely starts like a field of another model's schema is not that field
    (None, "static_batching: the request was cancelled", 500, None),
])
def test_tritons_errors_map_onto_openais(status, message, code, param):
    error = errors.from_triton(status, message, INPUTS, {"text_input": "prompt"})
    assert (error.status, error.param) == (code, param)
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"].endswith(message.split(": ", 1)[-1])
    assert body["type"] == {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                            503: "service_unavailable", 500: "server_error", 504: "server_error"}[code]


def test_a_chat_stream_is_role_then_text_then_finish_then_usage():
    envelope = Envelope("chatcmpl-1", True, 5, "continuous_batching")
    first, text, final = (envelope.chunk("", role=True, with_usage_field=True),
                          envelope.chunk("Hi", with_usage_field=True),
                          envelope.chunk(None, "length", with_usage_field=True))
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text["choices"][0] == {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "length"
    usage = envelope.usage_chunk(Usage(3, 4))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert sse({"a": 1}) == 'data: {"a":1}\n\n' and DONE == "data: [DONE]\n\n"


def test_whole_answers_have_openais_shape():
    completion_body = Envelope("cmpl-1", False, 5, "m").body([Choice("text", "stop")], Usage(2, 3))
    assert completion_body["object"] == "text_completion" and "usage" not in Envelope("c", False, 5, "m").chunk("x")
    assert completion_body["choices"] == [{"index": 0, "text": "text", "logprobs": None, "finish_reason": "stop"}]
    chat_body = Envelope("chatcmpl-1", True, 5, "m").body([Choice("text", "length")], None)
    assert chat_body["object"] == "chat.completion" and chat_body["usage"] is None
    assert chat_body["choices"][0]["message"] == {"role": "assistant", "content": "text"}


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_a_checkpoint_without_a_chat_template_gets_the_plain_one(tmp_path):
    assert plain_prompt(MESSAGES) == "system: Be brief.\nuser: Hi\nassistant:"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_chat_template(tmp_path) == ChatTemplate() == load_chat_template(None)
    assert load_chat_template(tmp_path / "absent").render(MESSAGES) == plain_prompt(MESSAGES)


def test_the_default_checkpoints_chat_template_renders_each_turn_and_the_assistants(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": DEFAULT_CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    rendered = load_chat_template(tmp_path).render(MESSAGES)
    assert rendered == "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"


def test_a_template_that_refuses_the_messages_names_messages():
    template = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(InvalidArgument, match="^messages: the model's chat template refused them: only user turns"):
        template.render(MESSAGES)
    with pytest.raises(InvalidArgument) as broken:
        ChatTemplate("{% for %}").render(MESSAGES)
    assert broken.value.field == "messages"


def _config(batched: bool, decoupled: bool) -> dict:
    types = {"text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "seed": "TYPE_UINT64", "stop": "TYPE_STRING",
             "ignore_eos": "TYPE_BOOL", "temperature": "TYPE_FP32"}
    config = {"name": "m", "input": [{"name": n, "data_type": t} for n, t in types.items()],
              "parameters": {"model_dir": {"string_value": "models/absent"}}}
    if batched:
        config["max_batch_size"] = 8  # NOTE: gRPC's JSON leaves out fields at their default (0)
    if decoupled:
        config["model_transaction_policy"] = {"decoupled": True}
    return config


def test_model_info_reads_the_config_as_grpc_gives_it(monkeypatch):
    monkeypatch.delenv(MODEL_ENV)
    info = ModelInfo.from_config(_config(batched=True, decoupled=False))
    assert (info.batched, info.decoupled, info.model_dir) == (True, False, None)
    assert ModelInfo.from_config(_config(batched=False, decoupled=True)).decoupled
    monkeypatch.setenv(MODEL_ENV, str(TINY_MODEL_DIR))  # batchlm-serve --model: it replaces model_dir
    assert ModelInfo.from_config(_config(batched=True, decoupled=False)).model_dir == TINY_MODEL_DIR


@pytest.mark.parametrize("batched, shape", [(False, [1]), (True, [1, 1])])
def test_inputs_are_typed_as_the_model_declares_with_a_batch_dimension_where_it_batches(batched, shape):
    info = ModelInfo.from_config(_config(batched, decoupled=False))
    tensors = {t.name(): t for t in infer_inputs(
        info, {"text_input": "hi", "max_tokens": 4, "seed": 2**63, "stop": ["a", "b"], "ignore_eos": True}, {})}
    assert {n: t.datatype() for n, t in tensors.items()} == {
        "text_input": "BYTES", "max_tokens": "INT32", "seed": "UINT64", "stop": "BYTES", "ignore_eos": "BOOL"}
    assert tensors["max_tokens"].shape() == shape
    assert tensors["stop"].shape() == ([1, 2] if batched else [2])
    assert np.frombuffer(tensors["seed"]._get_content(), np.uint64)[0] == 2**63


def test_a_parameter_the_model_does_not_take_is_a_400_naming_it():
    info = ModelInfo.from_config(_config(batched=False, decoupled=True))
    with pytest.raises(ApiError, match="^top_k: m does not take this parameter"):
        infer_inputs(info, {"text_input": "hi", "max_tokens": 4, "top_k": 3}, {})
    with pytest.raises(ApiError) as refused:
        infer_inputs(info, {"text_input": "hi", "max_tokens": 2**40}, {"max_tokens": "max_completion_tokens"})
    assert refused.value.param == "max_completion_tokens"


def test_the_frontend_listens_on_loopback_unless_told_otherwise():
    assert parse_args([]).host == "127.0.0.1" and parse_args(["--host", "0.0.0.0"]).host == "0.0.0.0"
    command = FrontendProcess("127.0.0.1:8001").command()
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert parse_args(["--models", "dynamic_batching,"]).models == ("dynamic_batching",)


def test_a_message_may_carry_keys_of_its_own_and_a_name_that_reaches_the_template():
    body = chat(messages=[{"role": "system", "content": "Be brief.", "type": "message"},
                          {"role": "user", "name": "ada", "content": [{"type": "text", "text": "Hi", "id": 7},
                                                                      {"type": "text", "text": " there"}]}])
    messages = template_messages(body.messages)
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi there", "name": "ada"}]
    named = ChatTemplate("{% for m in messages %}{{ m.name or m.role }}: {{ m.content }}\n{% endfor %}")
    assert named.render(messages) == "system: Be brief.\nada: Hi there\n"
    with pytest.raises(ValidationError):  # the body's own parameters stay strict
        chat(messages=[{"role": "user", "content": "Hi"}], temprature=0.5)
    with pytest.raises(ValidationError):  # and so do a message's: a part that is not text is refused
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_a_finish_reason_openai_does_not_know_is_left_out():
    assert [finish_reason_of(r) for r in ("length", "stop", "cancelled", "", None)] == ["length", "stop", None, None,
                                                                                          None]


def test_tokenize_takes_a_prompt_or_messages_and_detokenize_names_a_bad_id():
    tokenizer = load_tokenizer("m", TINY_MODEL_DIR)
    with_bos = tokenize(tokenizer, "Hi there", add_special_tokens=True)
    assert tokenizer.add_bos and with_bos[0] == tokenizer.bos_token_id
    assert tokenize(tokenizer, "Hi there", add_special_tokens=False) == with_bos[1:]
    assert detokenize(tokenizer, with_bos) == "Hi there"
    with pytest.raises(ApiError, match=r"^tokens: ids must be in \[0, ") as bad:
        detokenize(tokenizer, [1, tokenizer.vocab_size])
    assert bad.value.param == "tokens"
    with pytest.raises(ApiError) as unreadable:
        load_tokenizer("m", None)
    assert unreadable.value.param == "model"
    for body in ({"model": "m"}, {"model": "m", "prompt": "a", "messages": [{"role": "user", "content": "a"}]}):
        with pytest.raises(ValidationError):
            TokenizeRequest.model_validate_json(json.dumps(body))
