"""The shared request schema: valid inputs parse, every malformed one names its field, what a caller builds
is what the server parses, and every kind of response reads as the same Chunk."""

import subprocess
import sys

import numpy as np
import pytest

from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument
from batchlm.request_schema import (
    INPUTS,
    Chunk,
    MalformedResponse,
    check_parameters,
    input_arrays,
    parse_inputs,
    request_fields,
)


def base(**extra):
    inputs = {"text_input": np.array([b"Hello"], dtype=object), "max_tokens": np.array([8], np.int32)}
    inputs.update(extra)
    return inputs


def server_parse(inputs) -> tuple[dict, SamplingParams]:
    """What the server does with a request's arrays (triton_io.generate_request): the fields, then the
    SamplingParams of its sampling fields, which checks their ranges."""
    fields = parse_inputs(inputs)
    return fields, SamplingParams(**{k: v for k, v in fields.items() if k not in ("text_input", "input_ids", "stream")})


def test_minimal_request():
    fields, params = server_parse(base())
    assert fields == {"text_input": "Hello", "max_tokens": 8}
    assert params.max_tokens == 8 and params.temperature == INPUTS["temperature"].default == 0.0


def test_all_fields_and_batched_shapes():
    fields, p = server_parse({
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
    assert fields["text_input"] == "Hi é" and fields["stream"] is True
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
    ("stop", base(stop=np.array([b"x"] * 17, dtype=object))),
    ("stream", base(stream=np.array([1], np.int32))),
    ("ignore_eos", base(ignore_eos=np.array([b"yes"], dtype=object))),
    ("bogus", base(bogus=np.array([1], np.int32))),
    ("input_ids", base(input_ids=np.array([1, 2], np.int32))),  # both prompts
    ("input_ids", {"input_ids": np.array([], np.int32), "max_tokens": np.array([8], np.int32)}),
    ("input_ids", {"input_ids": np.array([1.0], np.float32), "max_tokens": np.array([8], np.int32)}),
    ("input_ids", {"input_ids": np.ones(64 * 1024 + 1, np.int32), "max_tokens": np.array([8], np.int32)}),
    ("logprobs", base(logprobs=np.array([21], np.int32))),
    ("logit_bias", base(logit_bias=np.array([1.0], np.float32))),  # no ids
    ("logit_bias", base(logit_bias_ids=np.array([1, 2], np.int32), logit_bias=np.array([1.0], np.float32))),
    ("logit_bias", base(logit_bias_ids=np.array([1], np.int32), logit_bias=np.array([101.0], np.float32))),
    ("min_tokens", base(min_tokens=np.array([9], np.int32))),
    ("repetition_penalty", base(repetition_penalty=np.array([0.0], np.float32))),
    ("prompt_logprobs", base(prompt_logprobs=np.array([-1], np.int32))),
])
def test_malformed_input_names_field(field, inputs):
    with pytest.raises(InvalidArgument) as info:
        server_parse(inputs)
    assert info.value.field == field
    assert field in str(info.value)


def test_a_request_parameter_is_refused_unless_it_is_the_servers():
    check_parameters({"timeout": 5, "triton_enable_empty_final_response": True})
    with pytest.raises(InvalidArgument, match="^temprature: unknown field; expected one of"):
        check_parameters({"temprature": 0.7})
    with pytest.raises(InvalidArgument, match="^timeout: must be an integer >= 0"):
        check_parameters({"timeout": -1})


@pytest.mark.parametrize("declared, batched", [(None, False), ({"max_tokens": "TYPE_INT64"}, True)])
def test_what_a_caller_builds_is_what_the_server_parses(declared, batched):
    fields = request_fields("Hi é", 5, temperature=0.5, top_k=3, top_p=0.75, seed=2**64 - 1, stop=["a", "b"],
                            ignore_eos=True, stream=True)
    arrays = {name: (wire, array) for name, wire, array in input_arrays(fields, declared, batched)}
    assert {name: wire for name, (wire, _) in arrays.items()} == {
        "text_input": "BYTES", "max_tokens": "INT64" if declared else "INT32", "temperature": "FP32",
        "top_k": "INT32", "top_p": "FP32", "seed": "UINT64", "stop": "BYTES", "ignore_eos": "BOOL", "stream": "BOOL"}
    assert arrays["max_tokens"][1].shape == ((1, 1) if batched else (1,))
    assert arrays["stop"][1].shape == ((1, 2) if batched else (2,))
    assert parse_inputs({name: array for name, (_, array) in arrays.items()}) == {**fields, "stop": ("a", "b")}


def test_request_fields_leave_out_none_and_refuse_what_the_wire_cannot_carry():
    assert request_fields("p", 4, temperature=None, stop=None) == {"text_input": "p", "max_tokens": 4}
    with pytest.raises(ValueError, match="unknown request field 'temprature'"):
        request_fields("p", 4, temprature=0.5)
    with pytest.raises(InvalidArgument, match=r"^max_tokens: must be between -2147483648 and 2147483647"):
        request_fields("p", 2**31)
    with pytest.raises(InvalidArgument, match=r"^seed: must be between 0 and 18446744073709551615, got -1"):
        request_fields("p", 4, seed=-1)


def test_every_kind_of_response_reads_as_the_same_chunk():
    arrays = {"text_output": np.array([[b"Hi"]], dtype=object), "finish_reason": np.array([b"length"], dtype=object),
              "num_input_tokens": np.array([3], np.int32), "num_output_tokens": np.array([[2]], np.int32)}
    want = Chunk("Hi", "length", 3, 2)
    assert Chunk.from_outputs(arrays.get) == want                                          # gRPC's as_numpy
    generate = {"model_name": "m", "text_output": "Hi", "finish_reason": "length", "num_input_tokens": 3,
                "num_output_tokens": 2}
    assert Chunk.from_outputs(generate.get) == want                                        # /generate
    infer = {"text_output": ["Hi"], "finish_reason": ["length"], "num_input_tokens": [[3]], "num_output_tokens": [2]}
    assert Chunk.from_outputs(infer.get) == want                                           # /infer's data
    # a streamed response that does not end the request, and a narrower model without counters
    assert Chunk.from_outputs({"text_output": " w0", "finish_reason": ""}.get) == Chunk(" w0", "", None, None)
    with pytest.raises(MalformedResponse, match="no text_output"):
        Chunk.from_outputs({"finish_reason": "stop"}.get)


def test_importing_the_schema_loads_no_torch_and_no_triton_client():
    code = ("import sys, batchlm.request_schema; "
            "print(sorted(m for m in ('torch', 'tritonclient', 'triton_python_backend_utils') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_a_prompt_of_token_ids_travels_as_input_ids():
    fields = request_fields([1, 2, 3], 4, logprobs=2)
    assert fields == {"input_ids": [1, 2, 3], "max_tokens": 4, "logprobs": 2}
    arrays = {name: array for name, _, array in input_arrays(fields)}
    assert arrays["input_ids"].dtype == np.int32
    assert parse_inputs(arrays) == {"input_ids": (1, 2, 3), "max_tokens": 4, "logprobs": 2}
    with pytest.raises(ValueError):
        request_fields("hi", 4, input_ids=[1])


def test_a_logit_bias_travels_as_two_arrays():
    fields = request_fields("hi", 4, logit_bias={7: -1.5, 3: 2.0}, min_tokens=2, presence_penalty=0.5)
    arrays = {name: array for name, _, array in input_arrays(fields)}
    assert arrays["logit_bias_ids"].tolist() == [7, 3] and arrays["logit_bias"].dtype == np.float32
    fields, params = server_parse(arrays)
    assert params.logit_bias == ((7, -1.5), (3, 2.0)) and params.min_tokens == 2
    assert params.presence_penalty == 0.5 and "logit_bias_ids" not in fields
