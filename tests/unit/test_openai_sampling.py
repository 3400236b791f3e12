"""The OpenAI frontend's sampling parameters and structured output, with no server: each mapped onto the
schema input of its name, the guide of `response_format` and vLLM's `guided_*`, and what the frontend
refuses itself (the ranges are the engine's, whose errors name the schema field: `params` turns them
into the parameter sent)."""

from __future__ import annotations

import json
import re

import pytest

from batchlm.engine.guided_decoding import GuideCompiler
from batchlm.frontend import errors
from batchlm.frontend.errors import ApiError
from batchlm.frontend.guides import choice_regex
from batchlm.frontend.protocol import ChatCompletionRequest, CompletionRequest
from batchlm.frontend.schema_request import chat_request, completion_request
from batchlm.model.tokenizer import Tokenizer
from batchlm.paths import TINY_MODEL_DIR
from batchlm.request_schema import INPUTS

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}


def completion(**body) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "hi", **body}))


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}))


def test_penalties_min_tokens_and_logit_bias_map_onto_the_inputs_of_their_names():
    fields = completion_request(completion(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
                                           min_tokens=3, seed=9, logit_bias={"42": 100, "7": -100})).fields
    assert {k: fields[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                                   "seed")} == {"presence_penalty": 0.5, "frequency_penalty": -1,
                                                "repetition_penalty": 1.2, "min_tokens": 3, "seed": 9}
    assert (fields["logit_bias_ids"], fields["logit_bias"]) == ([42, 7], [100.0, -100.0])
    assert set(fields) <= set(INPUTS)
    chat_fields = chat_request(chat(presence_penalty=1, logit_bias={"5": 2}), "P").fields
    assert chat_fields["presence_penalty"] == 1 and chat_fields["logit_bias_ids"] == [5]


@pytest.mark.parametrize("field, param", [
    ("presence_penalty", "presence_penalty"), ("logit_bias_ids", "logit_bias"), ("logit_bias", "logit_bias"),
    ("min_tokens", "min_tokens"), ("input_ids", "prompt"), ("guided_decoding_guide", "guided_regex"),
])
def test_the_engines_refusal_of_a_field_names_the_parameter_sent(field, param):
    schema = completion_request(completion(presence_penalty=3, logit_bias={"1": 1}, min_tokens=2,
                                           guided_regex="("))
    error = errors.from_triton("StatusCode.INVALID_ARGUMENT", f"{field}: is out of range", INPUTS, schema.params)
    assert (error.status, error.param) == (400, param) and error.message == f"{param}: is out of range"


@pytest.mark.parametrize("body, guide", [
    ({"response_format": {"type": "json_object"}}, ("json", None, "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     ("json_schema", json.dumps(SCHEMA), "response_format")),
    ({"guided_json": SCHEMA}, ("json_schema", json.dumps(SCHEMA), "guided_json")),
    ({"guided_json": '{"type": "object"}'}, ("json_schema", '{"type": "object"}', "guided_json")),
    ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+", "guided_regex")),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, ("ebnf_grammar", 'root ::= "yes" | "no"', "guided_grammar")),
    ({"guided_choice": ["yes", "no"]}, ("regex", "(yes|no)", "guided_choice")),
])
def test_structured_output_becomes_the_schemas_guide(body, guide):
    for schema in (completion_request(completion(**body)), chat_request(chat(**body), "P")):
        kind, text, param = guide
        assert schema.fields["guided_decoding_guide_type"] == kind
        assert schema.fields.get("guided_decoding_guide") == text
        assert schema.params["guided_decoding_guide"] == schema.params["guided_decoding_guide_type"] == param


def test_a_text_response_format_is_no_guide():
    fields = chat_request(chat(response_format={"type": "text"}), "P").fields
    assert "guided_decoding_guide_type" not in fields and "guided_decoding_guide" not in fields


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_json": SCHEMA}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "a", "schema": {}}}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
])
def test_two_guides_or_an_incomplete_one_is_a_400_naming_it(body, param):
    with pytest.raises(ApiError) as refused:
        chat_request(chat(**body), "P")
    assert (refused.value.status, refused.value.param) == (400, param)


def test_a_choice_regex_matches_each_choice_exactly_and_compiles_for_the_engine():
    choices = ["a.b", "(x|y)", "1+1=2", "#tag & more~", "a-b [c]", "^$\\"]
    pattern = choice_regex(choices)
    assert all(re.fullmatch(pattern, c) for c in choices)
    assert not re.fullmatch(pattern, "axb") and not re.fullmatch(pattern, "x")
    tokenizer = Tokenizer.from_dir(TINY_MODEL_DIR)
    GuideCompiler(tokenizer.hf.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids).check("regex", pattern)


def test_the_sdks_parse_body_is_accepted():
    """What `client.chat.completions.parse(response_format=SomeModel)` sends."""
    from pydantic import BaseModel

    from openai.lib._parsing._completions import type_to_response_format_param

    class Pet(BaseModel):
        name: str

    response_format = type_to_response_format_param(Pet)
    schema = chat_request(chat(response_format=response_format), "P")
    assert schema.fields["guided_decoding_guide_type"] == "json_schema"
    assert json.loads(schema.fields["guided_decoding_guide"])["properties"] == {"name": {"title": "Name",
                                                                                      "type": "string"}}
