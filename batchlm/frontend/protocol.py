"""OpenAI's request bodies (pydantic) and their mapping onto the shared request schema.

The schema (batchlm/request_schema.py) has `text_input`, `max_tokens`, `temperature`, `top_k`,
`top_p`, `seed`, `stop`, `ignore_eos` and `stream`. OpenAI's parameters map onto them one to one;
`top_k` and `ignore_eos` are extensions. A parameter left out is left out of the request too, so the
model's default applies, except `temperature`, 1 as OpenAI's API has it (the models' own default is
greedy), and `max_tokens`, which the schema requires: 16 for completions (OpenAI's default), and for
chat what is left of the model's context after the prompt (128 where the frontend cannot read the
model's checkpoint to count the prompt). An integer its input's type cannot hold is a 400 here; ranges
are the models' to check: their INVALID_ARG names the field, and errors.from_triton turns it into a 400
naming the parameter.
Log-probabilities map onto the schema's `logprobs` (completions' `logprobs`, chat's `top_logprobs`
where `logprobs` is true; their range, 0 to MAX_LOGPROBS, is checked here) and, for a completion's
`echo`, `prompt_logprobs`; `echo` with `max_tokens: 0` (scoring a prompt alone) asks for one token,
which the answer leaves out (`keep_output`).
Parameters the models cannot honour are refused with a 400 naming them, unless they hold their neutral
value (`presence_penalty: 0`, `best_of: 1`, ...). Unknown parameters are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from batchlm.errors import InvalidArgument
from batchlm.frontend.errors import invalid
from batchlm.request_schema import MAX_LOGPROBS, request_fields

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 128
# OpenAI's API samples at temperature 1 when a request names none; `temperature: 0` is greedy
DEFAULT_TEMPERATURE = 1.0


class _Body(BaseModel):
    # NOTE: strict: "8" is not 8 and true is not 1; extra="forbid": a misspelt parameter is refused,
    # not dropped in silence
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """What completions and chat share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions of the shared schema
    top_k: int | None = None
    ignore_eos: bool | None = None
    # accepted at their neutral value only (see NEUTRAL)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class _Message(BaseModel):
    # NOTE: extra="ignore": clients send keys of their own in a message (lm-evaluation-harness a `type`,
    # others ids or metadata), which OpenAI ignores; the body's own parameters stay strict
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class TextPart(_Message):
    type: Literal["text"]
    text: str


class ChatMessage(_Message):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template reads them: `role` and `content` (text parts joined), and `name`
    where the client gave one."""
    return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
            for m in messages]


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's shape): `prompt` or `messages`, not both."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True     # False: no BOS, the ids of the text alone

    @model_validator(mode="after")
    def _one_source(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's shape)."""

    model: str
    tokens: list[int]


# parameter -> the values that change nothing (None always does)
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
    "suffix": ("",), "best_of": (1,),
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
}


@dataclass(frozen=True)
class SchemaRequest:
    """One request in the shared schema's terms: `fields` (schema field -> value, left-out ones absent)
    and `params` (schema field -> the OpenAI parameter it came from, for error messages)."""

    fields: dict[str, object]
    params: dict[str, str] = field(default_factory=dict)
    stream: bool = False          # the caller asked for server-sent events
    include_usage: bool = False   # stream_options.include_usage
    logprobs: int | None = None   # the alternatives asked for at each token; None: no log-probabilities
    echo: bool = False            # a completion's `echo`: the prompt comes first in its text (and logprobs)
    keep_output: bool = True      # False: `echo` with `max_tokens: 0`; the one token generated is left out


def completion_request(body: CompletionRequest) -> SchemaRequest:
    """The schema request for a completion; ApiError 400 naming the parameter where it cannot be one."""
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise invalid("prompt", f"one prompt per request is supported, got a list of {len(prompt)}")
        prompt = prompt[0]
    logprobs = _alternatives(body.logprobs, "logprobs")
    echo = bool(body.echo)
    # NOTE: the engine generates at least one token; `echo` with `max_tokens: 0` scores the prompt alone
    keep_output = not (echo and body.max_tokens == 0)
    schema = _schema_request(body, prompt, "prompt", body.max_tokens if keep_output else 1, "max_tokens",
                             DEFAULT_COMPLETION_MAX_TOKENS, logprobs, "logprobs", echo=echo)
    return replace(schema, keep_output=keep_output)


def chat_request(body: ChatCompletionRequest, prompt: str,
                 default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS) -> SchemaRequest:
    """The schema request for a chat completion whose messages rendered to `prompt`; `default_max_tokens`
    where it names neither `max_tokens` nor `max_completion_tokens` (the caller passes what is left of the
    model's context where it knows it)."""
    top = _alternatives(body.top_logprobs, "top_logprobs")
    if top and not body.logprobs:
        raise invalid("top_logprobs", f"asks for {top} alternatives per token, which needs logprobs: true")
    logprobs = (top or 0) if body.logprobs else None
    if body.max_completion_tokens is not None:
        if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise invalid("max_completion_tokens", f"differs from max_tokens ({body.max_completion_tokens} "
                                                   f"!= {body.max_tokens}); give one of them")
        return _schema_request(body, prompt, "messages", body.max_completion_tokens, "max_completion_tokens",
                               default_max_tokens, logprobs, "top_logprobs" if top else "logprobs")
    return _schema_request(body, prompt, "messages", body.max_tokens, "max_tokens", default_max_tokens,
                           logprobs, "top_logprobs" if top else "logprobs")


def _alternatives(value: int | None, param: str) -> int | None:
    """A count of most likely alternatives per token, checked against the schema's MAX_LOGPROBS."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise invalid(param, f"must be between 0 and {MAX_LOGPROBS}, got {value}")
    return value


def _schema_request(body: _Sampling, prompt: str, prompt_param: str, max_tokens: int | None,
                    max_tokens_param: str, default_max_tokens: int, logprobs: int | None = None,
                    logprobs_param: str = "logprobs", echo: bool = False) -> SchemaRequest:
    """The schema request; with `echo` and `logprobs`, the prompt's log-probabilities too."""
    _refuse_unsupported(body)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "is allowed only with stream: true")
    params = {"text_input": prompt_param, "max_tokens": max_tokens_param}
    prompt_logprobs = logprobs if echo else None
    if logprobs is not None:
        params["logprobs"] = logprobs_param
    if prompt_logprobs is not None:
        params["prompt_logprobs"] = logprobs_param
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        fields = request_fields(prompt, default_max_tokens if max_tokens is None else max_tokens,
                                temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                                top_p=body.top_p, top_k=body.top_k,
                                seed=body.seed, stop=stops or None, ignore_eos=body.ignore_eos,
                                logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except InvalidArgument as exc:
        raise invalid(params.get(exc.field, exc.field), exc.message) from None
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return SchemaRequest(fields, params, stream=bool(body.stream), include_usage=include_usage, logprobs=logprobs,
                         echo=echo)


def _refuse_unsupported(body: _Sampling) -> None:
    if body.n is not None and body.n != 1:
        raise invalid("n", f"only n=1 is supported (one choice per request), got {body.n}; "
                           "send n requests instead")
    for name, neutral in NEUTRAL.items():
        value = getattr(body, name, None)
        if value is not None and value not in neutral:
            raise invalid(name, f"is not supported by these models; leave it out (got {value!r})")
