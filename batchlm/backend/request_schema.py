"""The one request schema shared by every model in the repository.

Input and output names follow Triton's LLM backends (vLLM, TensorRT-LLM), so existing client code
works. This module is pure (numpy only): it turns the arrays a Triton request carries into a
`GenerateRequest`, and fails with `InvalidArgument` naming the field on anything malformed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from batchlm.engine.sampling import SamplingParams
from batchlm.errors import InvalidArgument

# name -> (Triton data type, required)
INPUTS: dict[str, tuple[str, bool]] = {
    "text_input": ("TYPE_STRING", True),
    "max_tokens": ("TYPE_INT32", True),
    "temperature": ("TYPE_FP32", False),
    "top_k": ("TYPE_INT32", False),
    "top_p": ("TYPE_FP32", False),
    "seed": ("TYPE_UINT64", False),
    "stop": ("TYPE_STRING", False),
    "ignore_eos": ("TYPE_BOOL", False),
    "stream": ("TYPE_BOOL", False),
}
OUTPUTS: dict[str, str] = {
    "text_output": "TYPE_STRING",
    "finish_reason": "TYPE_STRING",
    "num_input_tokens": "TYPE_INT32",
    "num_output_tokens": "TYPE_INT32",
}

MAX_PROMPT_BYTES = 64 * 1024


@dataclass(frozen=True)
class GenerateRequest:
    """One parsed, validated generation request."""

    prompt: str
    params: SamplingParams
    stream: bool


def check_parameters(parameters: Mapping[str, object]) -> None:
    """Refuse a request's parameters: the schema has none. HTTP `/generate` turns every JSON field that
    matches no input into a parameter, so a misspelt field (`"temprature": 0.7`) arrives here and would
    otherwise be dropped in silence. Names with Triton's reserved prefix `triton_` are the server's own;
    `timeout` is Triton's per-request timeout (a `/generate` client's way to set it), checked here.

    Raises:
        InvalidArgument: naming the first parameter that is not the server's.
    """
    for name, value in parameters.items():
        if name == "timeout":  # Triton's per-request timeout, as a `/generate` field (Triton reads it from
            # gRPC and /infer requests itself): microseconds, 0 = none
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(name, f"must be an integer >= 0 (microseconds), got {value!r}")
        elif not name.startswith("triton_"):
            raise InvalidArgument(name, f"unknown field; expected one of {sorted(INPUTS)}")


def parse_inputs(inputs: Mapping[str, np.ndarray]) -> GenerateRequest:
    """Validate a request's input arrays (any shape holding the right count of elements).

    Raises:
        InvalidArgument: a required input is missing, a value has the wrong count, type or range.
    """
    for name in inputs:
        if name not in INPUTS:
            raise InvalidArgument(name, f"unknown input; expected one of {sorted(INPUTS)}")
    for name, (_, required) in INPUTS.items():
        if required and name not in inputs:
            raise InvalidArgument(name, "is required")

    raw = _scalar(inputs, "text_input")
    # NOTE: the size is checked on the bytes as they came, before anything decodes or tokenizes them
    if len(raw if isinstance(raw, (bytes, np.bytes_)) else str(raw).encode()) > MAX_PROMPT_BYTES:
        raise InvalidArgument("text_input", f"is longer than {MAX_PROMPT_BYTES} bytes")
    prompt = _text(raw, "text_input")
    if not prompt:
        raise InvalidArgument("text_input", "must not be empty")

    params: dict[str, object] = {"max_tokens": _int(inputs, "max_tokens")}
    if "temperature" in inputs:
        params["temperature"] = _float(inputs, "temperature")
    if "top_k" in inputs:
        params["top_k"] = _int(inputs, "top_k")
    if "top_p" in inputs:
        params["top_p"] = _float(inputs, "top_p")
    if "seed" in inputs:
        params["seed"] = _int(inputs, "seed")
    if "stop" in inputs:
        stops = np.asarray(inputs["stop"]).reshape(-1)
        params["stop"] = tuple(_text(s, "stop") for s in stops if _text(s, "stop"))
    if "ignore_eos" in inputs:
        params["ignore_eos"] = _bool(inputs, "ignore_eos")
    stream = _bool(inputs, "stream") if "stream" in inputs else False
    # SamplingParams validates ranges and raises InvalidArgument naming the field.
    return GenerateRequest(prompt=prompt, params=SamplingParams(**params), stream=stream)


def _scalar(inputs: Mapping[str, np.ndarray], name: str):
    flat = np.asarray(inputs[name]).reshape(-1)
    if flat.size != 1:
        raise InvalidArgument(name, f"must hold exactly one value, got {flat.size}")
    return flat[0]


def _text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(name, "is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise InvalidArgument(name, f"must be a string, got {type(value).__name__}")


def _int(inputs: Mapping[str, np.ndarray], name: str) -> int:
    value = _scalar(inputs, name)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(name, f"must be an integer, got {np.asarray(value).dtype}")
    return int(value)


def _float(inputs: Mapping[str, np.ndarray], name: str) -> float:
    value = _scalar(inputs, name)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (float, int, np.floating, np.integer)):
        raise InvalidArgument(name, f"must be a number, got {np.asarray(value).dtype}")
    value = float(value)
    if not np.isfinite(value):
        raise InvalidArgument(name, "must be finite")
    return value


def _bool(inputs: Mapping[str, np.ndarray], name: str) -> bool:
    value = _scalar(inputs, name)
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(name, f"must be a boolean, got {np.asarray(value).dtype}")
    return bool(value)
