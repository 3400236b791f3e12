"""OpenAI's response bodies and stream chunks, and the server-sent-event framing.

A stream is `data: <chunk JSON>\\n\\n` events: for chat, a first chunk with `delta: {"role":
"assistant", "content": ""}`; then one chunk per piece of text the model sent; then a chunk with no
text and the `finish_reason`; with `stream_options.include_usage`, a chunk with `choices: []` and the
`usage` (every other chunk then carries `usage: null`); then `data: [DONE]`. With several choices (`n`,
or a completion's list of prompts), each chunk carries one choice's `index`, each choice has its own
first and last chunk, and the choices' chunks interleave as their text comes. With log-probabilities,
a chunk carries those of the tokens the model sent with its text, which may be none yet (text held back
while a character or a stop string is unfinished). An error after the stream began is one event
`data: {"error": {...}}`, and the stream ends there, without `[DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

DONE = "data: [DONE]\n\n"

# The models' finish reasons that OpenAI has too. Any other (`cancelled`: the request was aborted) ends
# with none rather than a reason OpenAI's clients do not know.
FINISH_REASONS = {"length": "length", "stop": "stop"}


@dataclass(frozen=True)
class Usage:
    """Token counts from the models' `num_input_tokens`, `num_output_tokens` and `num_cached_tokens`
    outputs; `cached_tokens` None where the model does not answer it."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    def as_json(self) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


@dataclass(frozen=True)
class Choice:
    """One choice of a whole answer: its text, finish reason and `logprobs` (logprobs.py; None where none
    were asked for)."""

    text: str
    finish_reason: str | None
    logprobs: dict | None = None


@dataclass(frozen=True)
class Envelope:
    """What every body and chunk of one answer shares: its id, kind, creation time and model."""

    id: str
    chat: bool
    created: int
    model: str

    @classmethod
    def new(cls, model: str, chat: bool) -> "Envelope":
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", chat, int(time.time()), model)

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def body(self, choices: list[Choice], usage: Usage | None) -> dict:
        """The whole answer (not streamed), its choices in `index` order."""
        shaped = []
        for index, choice in enumerate(choices):
            if self.chat:
                shape = {"index": index, "message": {"role": "assistant", "content": choice.text}}
            else:
                shape = {"index": index, "text": choice.text}
            shape.update(logprobs=choice.logprobs, finish_reason=finish_reason_of(choice.finish_reason))
            shaped.append(shape)
        return {**self._head(chunk=False), "choices": shaped, "usage": usage.as_json() if usage is not None else None}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, index: int = 0, role: bool = False,
              with_usage_field: bool = False, logprobs: dict | None = None) -> dict:
        """One stream chunk of choice `index`: `text` (None: no content), the finish reason on its last one;
        `role`: a chat choice's first chunk; `with_usage_field`: `usage: null` (when a usage chunk will
        follow); `logprobs`: those of the tokens this chunk's text holds (or will hold, where a character
        is unfinished)."""
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(logprobs=logprobs, finish_reason=finish_reason_of(finish_reason))
        body = {**self._head(chunk=True), "choices": [choice]}
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        """The chunk after the last one when `stream_options.include_usage` is set."""
        return {**self._head(chunk=True), "choices": [], "usage": usage.as_json()}


def finish_reason_of(reason: str | None) -> str | None:
    if not reason:
        return None
    return FINISH_REASONS.get(reason)


def sse(payload: dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
