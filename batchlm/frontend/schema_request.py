"""An OpenAI request body (protocol.py) as requests of the shared schema: one per choice.

    schema = completion_request(body)        # or chat_request(body, prompt, default_max_tokens)
    schema.choices[i]                        # choice i's fields: one Triton request each

The schema's inputs (batchlm/request_schema.py) take OpenAI's parameters under their own names:
`max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `presence_penalty`, `frequency_penalty`,
and vLLM's `top_k`, `min_tokens`, `repetition_penalty`, `ignore_eos`; `logit_bias` (token id strings
-> bias) becomes `logit_bias_ids` and `logit_bias`; `response_format` and the `guided_*` extensions
become the guide (guides.py). A parameter left out is left out of the request too, so the model's
default applies, except `temperature`, 1 as OpenAI's API has it (the models' own default is greedy),
and `max_tokens`, which the schema requires: 16 for completions (OpenAI's default), and for chat what
is left of the model's context after the prompt (128 where the frontend cannot read the model's
checkpoint to count the prompt).

Ranges are the engine's to check (SamplingParams), in one place: a model's INVALID_ARG names the schema
field, and errors.from_triton turns it into a 400 naming the parameter sent (`params`). What only the
frontend knows is checked here: the shapes of prompts, `n`, the counts of log-probability alternatives
(0 to MAX_LOGPROBS), and integers that their input's type cannot hold.

Prompts and choices: a completion's `prompt` is one text, a list of texts, one prompt of token ids (a
list of integers) or a list of those; each prompt is asked `n` times. Choice `index` = prompt index * n
+ i holds prompt `index // n`; with a `seed`, choice i of each prompt has `seed + i` (as vLLM seeds
parallel samples), so n choices differ and each is reproducible.

Log-probabilities map onto the schema's `logprobs` (completions' `logprobs`, chat's `top_logprobs`
where `logprobs` is true) and, for a completion's `echo`, `prompt_logprobs`; `echo` with `max_tokens: 0`
(scoring a prompt alone) asks for one token, which the answer leaves out (`keep_output`).
Parameters the models cannot honour are refused with a 400 naming them, unless they hold their neutral
value (`suffix: ""`, `tools: []`, ...); `best_of` is accepted where it equals `n` (every sample is
returned, so none is chosen among them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from batchlm.errors import InvalidArgument
from batchlm.frontend.errors import invalid
from batchlm.frontend.guides import guide_of
from batchlm.frontend.protocol import ChatCompletionRequest, CompletionRequest, SamplingBody
from batchlm.request_schema import MAX_LOGPROBS, request_fields

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 128
# OpenAI's API samples at temperature 1 when a request names none; `temperature: 0` is greedy
DEFAULT_TEMPERATURE = 1.0
# Each choice is a request of its own in the model: a bound on what one HTTP request may ask of it
MAX_N = 8
MAX_CHOICES = 128   # prompts x n

# parameter -> the values that change nothing (None always does)
NEUTRAL: dict[str, tuple] = {
    "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
}

Prompt = str | tuple[int, ...]
_TOKEN_ID = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class SchemaRequest:
    """One OpenAI request in the shared schema's terms: `choices` (one request's fields per choice, in
    `index` order; left-out fields absent) and `params` (schema field -> the OpenAI parameter it came
    from, for error messages)."""

    choices: tuple[dict[str, object], ...]
    params: dict[str, str] = field(default_factory=dict)
    n: int = 1                    # choices per prompt
    stream: bool = False          # the caller asked for server-sent events
    include_usage: bool = False   # stream_options.include_usage
    logprobs: int | None = None   # the alternatives asked for at each token; None: no log-probabilities
    echo: bool = False            # a completion's `echo`: the prompt comes first in its text (and logprobs)
    keep_output: bool = True      # False: `echo` with `max_tokens: 0`; the one token generated is left out

    @property
    def fields(self) -> dict[str, object]:
        """The first choice's fields."""
        return self.choices[0]

    @property
    def prompts(self) -> int:
        return len(self.choices) // self.n

    def prompt(self, index: int) -> Prompt:
        """Choice `index`'s prompt: its text, or its token ids."""
        fields = self.choices[index]
        return fields["text_input"] if "text_input" in fields else tuple(fields["input_ids"])


def completion_request(body: CompletionRequest) -> SchemaRequest:
    """The schema request for a completion; ApiError 400 naming the parameter where it cannot be one."""
    prompts = _prompts(body.prompt)
    logprobs = _alternatives(body.logprobs, "logprobs")
    echo = bool(body.echo)
    n = _choices_per_prompt(body.n, len(prompts))
    if body.best_of is not None and body.best_of != n:
        raise invalid("best_of", f"only best_of = n ({n}) is supported: every sample is returned, got {body.best_of}")
    # NOTE: the engine generates at least one token; `echo` with `max_tokens: 0` scores the prompt alone
    keep_output = not (echo and body.max_tokens == 0)
    schema = _schema_request(body, prompts, n, "prompt", body.max_tokens if keep_output else 1, "max_tokens",
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
    logprobs_param = "top_logprobs" if top else "logprobs"
    n = _choices_per_prompt(body.n, 1)
    if body.max_completion_tokens is not None:
        if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise invalid("max_completion_tokens", f"differs from max_tokens ({body.max_completion_tokens} "
                                                   f"!= {body.max_tokens}); give one of them")
        return _schema_request(body, [prompt], n, "messages", body.max_completion_tokens, "max_completion_tokens",
                               default_max_tokens, logprobs, logprobs_param)
    return _schema_request(body, [prompt], n, "messages", body.max_tokens, "max_tokens", default_max_tokens,
                           logprobs, logprobs_param)


def _prompts(prompt: str | list) -> list[Prompt]:
    """A completion's prompts: each a text or a tuple of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt", "must not be empty: give a text, a list of texts, a list of token ids or "
                                "a list of lists of them")
    if isinstance(prompt[0], int):
        return [tuple(prompt)]
    if any(isinstance(p, list) and not p for p in prompt):
        raise invalid("prompt", "a prompt of token ids must not be empty")
    return [p if isinstance(p, str) else tuple(p) for p in prompt]


def _choices_per_prompt(n: int | None, prompts: int) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise invalid("n", f"must be between 1 and {MAX_N}, got {n}")
    if n * prompts > MAX_CHOICES:
        raise invalid("prompt" if n == 1 else "n", f"{prompts} prompts x n = {n} choices; at most {MAX_CHOICES} "
                                                   "per request")
    return n


def _alternatives(value: int | None, param: str) -> int | None:
    """A count of most likely alternatives per token, checked against the schema's MAX_LOGPROBS."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise invalid(param, f"must be between 0 and {MAX_LOGPROBS}, got {value}")
    return value


def _schema_request(body: SamplingBody, prompts: list[Prompt], n: int, prompt_param: str, max_tokens: int | None,
                    max_tokens_param: str, default_max_tokens: int, logprobs: int | None = None,
                    logprobs_param: str = "logprobs", echo: bool = False) -> SchemaRequest:
    """The schema request; with `echo` and `logprobs`, the prompt's log-probabilities too."""
    _refuse_unsupported(body)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "is allowed only with stream: true")
    guide = guide_of(body.response_format, body.guided_json, body.guided_regex, body.guided_grammar,
                     body.guided_choice)
    params = {"text_input": prompt_param, "input_ids": prompt_param, "max_tokens": max_tokens_param,
              "logit_bias_ids": "logit_bias"}
    prompt_logprobs = logprobs if echo else None
    if logprobs is not None:
        params["logprobs"] = logprobs_param
    if prompt_logprobs is not None:
        params["prompt_logprobs"] = logprobs_param
    if guide is not None:
        params["guided_decoding_guide_type"] = params["guided_decoding_guide"] = guide.param
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    options = dict(temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                   top_p=body.top_p, top_k=body.top_k, stop=stops or None, ignore_eos=body.ignore_eos,
                   min_tokens=body.min_tokens, presence_penalty=body.presence_penalty,
                   frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                   logit_bias=_logit_bias(body.logit_bias),
                   guided_decoding_guide_type=guide and guide.type, guided_decoding_guide=guide and guide.text,
                   logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    try:
        choices = tuple(request_fields(prompt, default_max_tokens if max_tokens is None else max_tokens,
                                       seed=None if body.seed is None else body.seed + i, **options)
                        for prompt in prompts for i in range(n))
    except InvalidArgument as exc:
        raise invalid(params.get(exc.field, exc.field), exc.message) from None
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return SchemaRequest(choices, params, n=n, stream=bool(body.stream), include_usage=include_usage,
                         logprobs=logprobs, echo=echo)


def _logit_bias(biases: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias`, keyed by token ids as JSON strings, keyed by the ids."""
    if not biases:
        return None
    bad = [token for token in biases if not _TOKEN_ID.fullmatch(token)]
    if bad:
        raise invalid("logit_bias", f"keys must be token ids (integers), got {bad[:8]}")
    return {int(token): bias for token, bias in biases.items()}


def _refuse_unsupported(body: SamplingBody) -> None:
    for name, neutral in NEUTRAL.items():
        value = getattr(body, name, None)
        if value is not None and value not in neutral:
            raise invalid(name, f"is not supported by these models; leave it out (got {value!r})")
