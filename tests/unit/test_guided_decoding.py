"""Guided decoding on the random-weight default model: the output matches its guide whatever the model
prefers, guided and free requests share a batch without changing each other's tokens, and a guide that
does not compile is refused naming the field. The real model's JSON: test_default_model_reference.py."""

import json
import re

import pytest

from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument
from tests.unit.test_engine import PROMPTS, make_engine

REGEX = "[0-9]{3}-[a-z]{2}"
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}


def guided(kind, guide=None, n=40, **kw):
    return SamplingParams(max_tokens=n, guided_decoding_guide_type=kind, guided_decoding_guide=guide, **kw)


def test_the_output_follows_its_guide_next_to_free_requests(parts):
    engine = make_engine(parts, max_num_batched_tokens=8)
    params = [guided("regex", REGEX), SamplingParams(max_tokens=12, ignore_eos=True),
              guided("json_schema", json.dumps(SCHEMA), n=60), SamplingParams(max_tokens=9, ignore_eos=True)]
    batched = engine.generate(PROMPTS, params)
    alone = [make_engine(parts).generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert re.fullmatch(REGEX, batched[0].text) and batched[0].finish_reason.value == "stop"
    value = json.loads(batched[2].text)
    assert value["color"] in ("red", "green", "blue") and 0 <= value["n"] <= 9 and set(value) == {"color", "n"}
    free = make_engine(parts).generate([PROMPTS[0]], SamplingParams(max_tokens=40))[0]
    assert not re.fullmatch(REGEX, free.text)  # the guide, not the model, made it match


def test_any_json_and_sampling_under_a_guide(parts):
    engine = make_engine(parts)
    out = engine.generate([PROMPTS[1]], guided("regex", "(yes|no), [a-c]{4}", temperature=1.0, seed=5))[0]
    assert re.fullmatch("(yes|no), [a-c]{4}", out.text)
    anything = engine.generate([PROMPTS[2]], guided("json", n=200))[0]
    assert anything.text.startswith("{")
    if anything.finish_reason.value == "stop":
        assert isinstance(json.loads(anything.text), dict)


@pytest.mark.parametrize("kind, guide, field", [
    ("regex", "a(b", "guided_decoding_guide"),
    ("json_schema", "{not json", "guided_decoding_guide"),
    ("lark", "start: nope(", "guided_decoding_guide"),
    ("xml", "x", "guided_decoding_guide_type"),
    ("regex", None, "guided_decoding_guide"),
    (None, "[a-z]", "guided_decoding_guide"),
])
def test_a_guide_that_cannot_be_followed_is_refused_naming_the_field(parts, kind, guide, field):
    engine = make_engine(parts)
    with pytest.raises(InvalidArgument) as err:
        engine.check_fits("hello", guided(kind, guide))
    assert err.value.field == field


def test_a_complete_guide_ends_the_output_even_before_min_tokens(parts):
    engine = make_engine(parts)
    out = engine.generate([PROMPTS[0]], guided("regex", "ab|cd", min_tokens=5))[0]
    assert out.text in ("ab", "cd") and out.finish_reason.value == "stop"
