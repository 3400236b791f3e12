"""OpenAI's response bodies and stream chunks, and the server-sent-event framing.

A stream is `data: <chunk JSON>\\n\\n` events: for chat, a first chunk with `delta: {"role":
"assistant", "content": ""}`; then one chunk per piece of text the model sent; then a chunk with no
text and the `finish_reason`; with `stream_options.include_usage`, a chunk with `choices: []` and the
`usage` (every other chunk then carries `usage: null`); then `data: [DONE]`. With log-probabilities,
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
    """Token counts from the models' `num_input_tokens` and `num_output_tokens` outputs."""

    prompt_tokens: int
    completion_tokens: int

    def as_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


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

    def body(self, text: str, finish_reason: str | None, usage: Usage | None, logprobs: dict | None = None) -> dict:
        """The whole answer (not streamed); `logprobs`: the choice's (logprobs.py), None where none were asked."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish_reason_of(finish_reason))
        return {**self._head(chunk=False), "choices": [choice],
                "usage": usage.as_json() if usage is not None else None}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              with_usage_field: bool = False, logprobs: dict | None = None) -> dict:
        """One stream chunk: `text` (None: no content), the finish reason on the last one; `role`: the
        chat stream's first chunk; `with_usage_field`: `usage: null` (when a usage chunk will follow);
        `logprobs`: those of the tokens this chunk's text holds (or will hold, where a character is unfinished)."""
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
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
