"""The request schema every model speaks, declared once: the server, the client, the OpenAI frontend and
the Locust users all import it.

Input and output names follow Triton's LLM backends (vLLM, TensorRT-LLM), so existing client code works.
A request travels as *fields* (schema name -> Python value, absent ones left out):

    fields = request_fields("Hello", 8, temperature=0.5)     # a client builds them
    arrays = input_arrays(fields)                             # (name, wire type, array) per input
    parse_inputs({name: array for name, _, array in arrays})  # the server checks them: fields again

and every response comes back as a `Chunk` (`Chunk.from_outputs`). The server applies each absent input's
`default`; the value ranges of the sampling fields are `batchlm.engine.sampling.SamplingParams`' to check,
with the limits declared here. Pure: numpy, batchlm.errors and batchlm.response_schema only (no torch,
no Triton client).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from batchlm.errors import InvalidArgument
# the responses are the other half of this schema (batchlm.response_schema reads them); callers may import
# them from here too
from batchlm.response_schema import Chunk, MalformedResponse, TokenLogprob, logprob_outputs  # noqa: F401

MAX_PROMPT_BYTES = 64 * 1024
MAX_PROMPT_IDS = 64 * 1024  # a prompt of ids is refused above this before anything else reads it
# Every new token is searched for every stop string on the engine thread that all requests share, so a
# request may carry only this many, this long.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# The most likely alternatives a request may ask for at each token (`logprobs`, `prompt_logprobs`): the
# top-k of a vocabulary-wide row costs the engine thread that all requests share.
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias, as OpenAI allows


@dataclass(frozen=True)
class DataType:
    """One Triton data type, as config.pbtxt, the wire (KServe v2, tritonclient) and numpy name it."""

    config: str   # "TYPE_INT32"
    wire: str     # "INT32"
    dtype: type   # np.int32

    @property
    def bounds(self) -> tuple[int, int] | None:
        """The integers this type holds, (low, high); None for a type that is not an integer."""
        if not np.issubdtype(self.dtype, np.integer):
            return None
        info = np.iinfo(self.dtype)
        return int(info.min), int(info.max)


# config data type -> DataType: every type a request field can be sent as (a model with a narrower
# schema may declare a field with another type than this schema's)
DATA_TYPES: dict[str, DataType] = {t.config: t for t in (
    DataType("TYPE_STRING", "BYTES", np.object_), DataType("TYPE_BOOL", "BOOL", np.bool_),
    DataType("TYPE_INT32", "INT32", np.int32), DataType("TYPE_INT64", "INT64", np.int64),
    DataType("TYPE_UINT32", "UINT32", np.uint32), DataType("TYPE_UINT64", "UINT64", np.uint64),
    DataType("TYPE_FP16", "FP16", np.float16), DataType("TYPE_FP32", "FP32", np.float32),
    DataType("TYPE_FP64", "FP64", np.float64),
)}
_STRING, _BOOL, _INT32, _UINT64, _FP32 = (DATA_TYPES[t] for t in
                                          ("TYPE_STRING", "TYPE_BOOL", "TYPE_INT32", "TYPE_UINT64", "TYPE_FP32"))


@dataclass(frozen=True)
class Field:
    """One input or output of every model, as its config.pbtxt declares it."""

    name: str
    data_type: DataType
    # an input: not `optional: true`; an output: every model answers it (a model with a narrower schema
    # may lack the others)
    required: bool
    meaning: str
    default: object = None          # what the server applies when an optional input is absent
    dims: tuple[int, ...] = (1,)    # config.pbtxt's dims; -1: any count


def _by_name(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


INPUTS: dict[str, Field] = _by_name(
    Field("text_input", _STRING, False, f"the prompt, UTF-8, at most {MAX_PROMPT_BYTES} bytes; a request carries "
                                        "it or input_ids"),
    Field("input_ids", _INT32, False, f"the prompt as token ids, at most {MAX_PROMPT_IDS}, in place of text_input",
          dims=(-1,)),
    Field("max_tokens", _INT32, True, "tokens to generate at most (finish reason `length`)"),
    Field("temperature", _FP32, False, "0 = greedy (argmax); > 0 scales the logits before sampling", 0.0),
    Field("top_k", _INT32, False, "keep the k most likely tokens; 0 = off", 0),
    Field("top_p", _FP32, False, "keep the smallest set with cumulative probability >= top_p; 1 = off", 1.0),
    Field("seed", _UINT64, False, "the request's own RNG seed; absent: the engine's global RNG", None),
    Field("stop", _STRING, False, f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters; "
                                  "the text ends before the first one it contains", (), dims=(-1,)),
    Field("ignore_eos", _BOOL, False, "keep generating past EOS (benchmarks)", False),
    Field("stream", _BOOL, False, "send the text as it is made (decoupled models only)", False),
    Field("min_tokens", _INT32, False, "generate at least this many tokens: EOS and stop strings do not end the "
                                       "text before (<= max_tokens)", 0),
    Field("presence_penalty", _FP32, False, "subtracted from the logit of every token the output already holds "
                                            "(-2..2), as OpenAI's", 0.0),
    Field("frequency_penalty", _FP32, False, "subtracted once per time the output holds the token (-2..2), as "
                                             "OpenAI's", 0.0),
    Field("repetition_penalty", _FP32, False, "> 0; a token of the prompt or output has its logit divided by it "
                                              "when positive, multiplied when negative; 1 = off", 1.0),
    Field("logit_bias_ids", _INT32, False, f"token ids whose logits logit_bias shifts (at most {MAX_LOGIT_BIAS})",
          (), dims=(-1,)),
    Field("logit_bias", _FP32, False, "added to the logit of each of logit_bias_ids (-100..100) before sampling",
          (), dims=(-1,)),
    Field("guided_decoding_guide_type", _STRING, False, "hold the output to a guide: `json` (any JSON "
                                                        "object), `json_schema`, `regex`, `ebnf_grammar` (GBNF) "
                                                        "or `lark`", None),
    Field("guided_decoding_guide", _STRING, False, "the schema, expression or grammar (not needed for `json`)", None),
    Field("logprobs", _INT32, False, "return the log-probability of each generated token and of its N most "
                                     f"likely alternatives (0 <= N <= {MAX_LOGPROBS}); absent: none", None),
    Field("prompt_logprobs", _INT32, False, "the same for every prompt token after the first (0 <= N <= "
                                            f"{MAX_LOGPROBS}), on the first response; absent: none", None),
)
OUTPUTS: dict[str, Field] = _by_name(
    Field("text_output", _STRING, True, "the text: a response's new text when streaming, else all of it"),
    Field("finish_reason", _STRING, False, "`length`, `stop` or `cancelled` on the response that ends the "
                                           "request; empty on the others"),
    Field("num_input_tokens", _INT32, False, "the prompt's tokens"),
    Field("num_output_tokens", _INT32, False, "the tokens generated so far"),
    Field("num_cached_tokens", _INT32, False, "the prompt's tokens whose KV came from the prefix cache"),
    Field("output_ids", _INT32, False, "the ids of the tokens text_output holds", dims=(-1,)),
    Field("output_log_probs", _FP32, False, "with `logprobs`: log p of each of output_ids given all before it, "
                                            "from the model's logits before temperature, top-k and top-p", dims=(-1,)),
    Field("output_top_ids", _INT32, False, "with `logprobs` N > 0: the N most likely ids at each position of "
                                           "output_ids, most likely first, position after position", dims=(-1,)),
    Field("output_top_log_probs", _FP32, False, "the log p of each of output_top_ids", dims=(-1,)),
    Field("prompt_ids", _INT32, False, "with `prompt_logprobs`, on the first response: the prompt's ids",
          dims=(-1,)),
    Field("prompt_log_probs", _FP32, False, "log p of each of prompt_ids but the first, given those before it",
          dims=(-1,)),
    Field("prompt_top_ids", _INT32, False, "with `prompt_logprobs` N > 0: the N most likely ids at each of "
                                           "those positions", dims=(-1,)),
    Field("prompt_top_log_probs", _FP32, False, "the log p of each of prompt_top_ids", dims=(-1,)),
)


# -- the server's side: arrays in, fields out ---------------------------------------------------------

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


def parse_inputs(inputs: Mapping[str, np.ndarray]) -> dict[str, object]:
    """A request's input arrays (any shape holding the right count of elements) as fields: each value
    of its input's type (`stop` a tuple of its non-empty strings), absent inputs left out. The sampling
    fields' ranges are SamplingParams' to check.

    Raises:
        InvalidArgument: an input is unknown, a required one missing, a value of the wrong count or type,
            the prompt empty, not UTF-8 or longer than MAX_PROMPT_BYTES.
    """
    for name in inputs:
        if name not in INPUTS:
            raise InvalidArgument(name, f"unknown input; expected one of {sorted(INPUTS)}")
    for name, spec in INPUTS.items():
        if spec.required and name not in inputs:
            raise InvalidArgument(name, "is required")

    fields: dict[str, object] = {"text_input": _prompt_text(inputs)} if "text_input" in inputs else {}
    if "input_ids" in inputs:
        if fields:
            raise InvalidArgument("input_ids", "a request carries text_input or input_ids, not both")
        fields["input_ids"] = _prompt_ids(inputs)
    elif not fields:
        raise InvalidArgument("text_input", "is required (or the prompt's token ids, input_ids)")

    if ("logit_bias" in inputs) != ("logit_bias_ids" in inputs):
        raise InvalidArgument("logit_bias", "logit_bias and logit_bias_ids come together, one value per id")
    for name in (n for n in INPUTS if n in inputs and n not in fields):
        if name == "logit_bias_ids":
            continue
        if name == "logit_bias":
            fields["logit_bias"] = _logit_bias(inputs)
        elif name == "stop":
            stops = (_text(s, "stop") for s in np.asarray(inputs["stop"]).reshape(-1))
            fields["stop"] = tuple(s for s in stops if s)
        else:
            fields[name] = _READERS[INPUTS[name].data_type.config](inputs, name)
    return fields


def _prompt_text(inputs: Mapping[str, np.ndarray]) -> str:
    raw = _scalar(inputs, "text_input")
    # NOTE: the size is checked on the bytes as they came, before anything decodes or tokenizes them
    if len(raw if isinstance(raw, (bytes, np.bytes_)) else str(raw).encode()) > MAX_PROMPT_BYTES:
        raise InvalidArgument("text_input", f"is longer than {MAX_PROMPT_BYTES} bytes")
    prompt = _text(raw, "text_input")
    if not prompt:
        raise InvalidArgument("text_input", "must not be empty")
    return prompt


def _prompt_ids(inputs: Mapping[str, np.ndarray]) -> tuple[int, ...]:
    """The ids as integers; whether the model knows them is its tokenizer's to say."""
    flat = np.asarray(inputs["input_ids"]).reshape(-1)
    if flat.size == 0:
        raise InvalidArgument("input_ids", "must not be empty")
    if flat.size > MAX_PROMPT_IDS:
        raise InvalidArgument("input_ids", f"at most {MAX_PROMPT_IDS} ids, got {flat.size}")
    if flat.dtype == np.bool_ or not np.issubdtype(flat.dtype, np.integer):
        raise InvalidArgument("input_ids", f"must be integers, got {flat.dtype}")
    return tuple(int(i) for i in flat.tolist())


def _logit_bias(inputs: Mapping[str, np.ndarray]) -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs of the two inputs; their ranges are SamplingParams' to check."""
    ids, biases = (np.asarray(inputs[n]).reshape(-1) for n in ("logit_bias_ids", "logit_bias"))
    if ids.size != biases.size:
        raise InvalidArgument("logit_bias", f"one value per id of logit_bias_ids: {biases.size} for {ids.size}")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise InvalidArgument("logit_bias_ids", f"must be integers, got {ids.dtype}")
    if biases.dtype == np.bool_ or not np.issubdtype(biases.dtype, np.number):
        raise InvalidArgument("logit_bias", f"must be numbers, got {biases.dtype}")
    return tuple(zip((int(i) for i in ids.tolist()), (float(b) for b in biases.tolist())))


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


def _string(inputs: Mapping[str, np.ndarray], name: str) -> str:
    return _text(_scalar(inputs, name), name)


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


# the reader of a scalar input other than the prompt, by its config data type
_READERS: dict[str, Callable[[Mapping[str, np.ndarray], str], object]] = {
    "TYPE_INT32": _int, "TYPE_UINT64": _int, "TYPE_FP32": _float, "TYPE_BOOL": _bool, "TYPE_STRING": _string,
}


# -- the caller's side: fields in, arrays out; responses in, Chunks out --------------------------------

def request_fields(prompt: str | Sequence[int], max_tokens: int, **options) -> dict[str, object]:
    """The fields of one request, its prompt a text (`text_input`) or token ids (`input_ids`); options
    valued None are left out (so the server's default applies).

    `logit_bias` is a mapping token id -> bias (sent as `logit_bias_ids` and `logit_bias`).

    Raises:
        ValueError: an option that is no input.
        InvalidArgument: an integer that its input's type cannot hold, naming the field.
    """
    fields: dict[str, object] = ({"text_input": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)})
    fields["max_tokens"] = int(max_tokens)
    for name, value in options.items():
        if name not in INPUTS or name in ("text_input", "input_ids", "logit_bias_ids"):
            raise ValueError(f"unknown request field {name!r}; expected one of {sorted(INPUTS)}")
        if value is None:
            continue
        if name == "logit_bias":  # a mapping token id -> bias, sent as two arrays
            if not isinstance(value, Mapping):
                raise ValueError(f"logit_bias must map token ids to biases, got {type(value).__name__}")
            if value:
                fields["logit_bias_ids"], fields[name] = [int(i) for i in value], [float(b) for b in value.values()]
        else:
            fields[name] = list(value) if name == "stop" else value
    for name, value in fields.items():
        check_bounds(name, value, INPUTS[name].data_type)
    return fields


def check_bounds(name: str, value: object, data_type: DataType) -> None:
    """Raise InvalidArgument naming `name` if `value` (one value or a list) is an integer out of `data_type`'s range."""
    bounds = data_type.bounds
    values = value if isinstance(value, (list, tuple)) else [value]
    if bounds is not None and any(isinstance(v, (int, np.integer)) and not bounds[0] <= v <= bounds[1]
                                  for v in values):
        raise InvalidArgument(name, f"must be between {bounds[0]} and {bounds[1]}, got {value}")


def input_arrays(fields: Mapping[str, object], declared: Mapping[str, str] | None = None,
                 batched: bool = False) -> list[tuple[str, str, np.ndarray]]:
    """(name, wire data type, array) per field, typed as the model declares it (`declared`: input name ->
    config data type, as its config.pbtxt has it; this schema's type where it names none this module
    knows), with a batch dimension of 1 where the model batches (max_batch_size > 0).

    Raises:
        InvalidArgument: an integer that the declared type cannot hold, naming the field.
    """
    declared = declared or {}
    arrays = []
    for name, value in fields.items():
        data_type = DATA_TYPES.get(declared.get(name, "")) or INPUTS[name].data_type
        check_bounds(name, value, data_type)
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if data_type.dtype is np.object_:
            values = [v.encode() if isinstance(v, str) else v for v in values]
        array = np.array(values, dtype=data_type.dtype)
        arrays.append((name, data_type.wire, array.reshape(1, -1) if batched else array))
    return arrays
