"""The shared request schema: valid inputs parse, every malformed one names its field."""

import numpy as np
import pytest

from batchlm.errors import InvalidArgument
from batchlm.backend.request_schema import parse_inputs


def base(**extra):
    inputs = {"text_input": np.array([b"Hello"], dtype=object), "max_tokens": np.array([8], np.int32)}
    inputs.update(extra)
    return inputs


def test_minimal_request():
    req = parse_inputs(base())
    assert req.prompt == "Hello" and req.params.max_tokens == 8 and not req.stream
    assert req.params.temperature == 0.0


def test_all_fields_and_batched_shapes():
    req = parse_inputs({
        "text_input": np.array([[b"Hi \xc3\xa9"]], dtype=object),
        "max_tokens": np.array([[4]], np.int32),
        "temperature": np.array([[0.7]], np.float32),
        "top_k": np.array([[5]], np.int32),
        "top_p": np.array([[0.9]], np.float32),
        "seed": np.array([[2**63]], np.uint64),
        "stop": np.array([[b"\n", b"END"]], dtype=object),
        "ignore_eos": np.array([[True]]),
        "stream": np.array([[True]]),
    })
    assert req.prompt == "Hi é" and req.stream
    p = req.params
    assert (p.max_tokens, p.top_k, p.seed, p.stop, p.ignore_eos) == (4, 5, 2**63, ("\n", "END"), True)
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)


@pytest.mark.parametrize("field, inputs", [
    ("text_input", {"max_tokens": np.array([8], np.int32)}),
    ("max_tokens", {"text_input": np.array([b"x"], dtype=object)}),
    ("text_input", base(text_input=np.array([b""], dtype=object))),
    ("text_input", base(text_input=np.array([b"\xff\xfe"], dtype=object))),
    ("text_input", base(text_input=np.array([b"a", b"b"], dtype=object))),
    ("max_tokens", base(max_tokens=np.array([0], np.int32))),
    ("max_tokens", base(max_tokens=np.array([1.5], np.float32))),
    ("temperature", base(temperature=np.array([-1.0], np.float32))),
    ("temperature", base(temperature=np.array([np.nan], np.float32))),
    ("top_k", base(top_k=np.array([-3], np.int32))),
    ("top_p", base(top_p=np.array([0.0], np.float32))),
    ("top_p", base(top_p=np.array([1.5], np.float32))),
    ("stream", base(stream=np.array([1], np.int32))),
    ("ignore_eos", base(ignore_eos=np.array([b"yes"], dtype=object))),
    ("bogus", base(bogus=np.array([1], np.int32))),
])
def test_malformed_input_names_field(field, inputs):
    with pytest.raises(InvalidArgument) as info:
        parse_inputs(inputs)
    assert info.value.field == field
    assert field in str(info.value)
