"""OpenAI's request bodies, as pydantic reads them: what a body may hold, not what it means.

What each parameter maps onto in the shared request schema is schema_request.py's (and guides.py's,
for structured output). The bodies are strict: "8" is not 8, true is not 1, and a parameter no body
declares is refused with a 400 naming it, rather than dropped in silence. Parameters the models cannot
honour are declared too, so that schema_request.py can accept them at their neutral value and refuse
any other value naming them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Body(BaseModel):
    # NOTE: strict: "8" is not 8 and true is not 1; extra="forbid": a misspelt parameter is refused,
    # not dropped in silence
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: a named JSON schema (the openai SDK's `.parse()` sends one)."""

    name: str
    description: str | None = None
    # NOTE: `schema` would shadow pydantic's own attribute; the body's key is still "schema"
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingBody(_Body):
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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None   # token id (a string, as JSON keys are) -> bias
    response_format: ResponseFormat | None = None
    # extensions, with vLLM's names
    top_k: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class CompletionRequest(SamplingBody):
    """POST /v1/completions. `prompt`: one text, a list of texts, one prompt of token ids, or a list of
    those; each prompt is answered with its own choices."""

    prompt: str | list[str] | list[int] | list[list[int]]
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


class ChatCompletionRequest(SamplingBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's shape): `prompt` or `messages`, not both. Without `model`, the tokenizer of
    the checkpoint every served model shares (tokenize.py)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True     # False: no BOS, the ids of the text alone

    @model_validator(mode="after")
    def _one_source(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's shape); `model` as for /tokenize."""

    model: str | None = None
    tokens: list[int]
