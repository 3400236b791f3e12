"""StreamBuffer: when a request's generated text is due to be sent, and what is due.

Shared by the models that answer per step (`continuous_batching`, `continuous_batching_trtllm`).
A streamed request gets its first text as soon as it exists, then a response once `interval` new
tokens are buffered, then its final response; a request that does not stream gets one answer, when it
finishes. Pure bookkeeping: no Triton, no threads (one owner per request).
"""

from __future__ import annotations

from batchlm.engine.request_output import RequestOutput


class StreamBuffer:
    def __init__(self, stream: bool, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.stream = stream
        self.interval = interval
        self._parts: list[RequestOutput] = []  # outputs not sent yet (all of them when not streaming)
        self._unsent_tokens = 0  # tokens generated since the last response
        self._sent_text = False  # a response with text was sent

    def take(self, out: RequestOutput) -> RequestOutput | None:
        """Buffer one output; what to send now (the buffered outputs joined: their text, possibly "" on
        the final one, ids and log-probabilities), or None if nothing is due yet."""
        self._parts.append(out)
        self._unsent_tokens += len(out.token_ids)
        due = out.finished or (self.stream and any(p.text for p in self._parts) and (
            not self._sent_text or self._unsent_tokens >= self.interval))
        if not due:
            return None
        joined = RequestOutput.concat(self._parts) if len(self._parts) > 1 else out
        self._parts.clear()
        self._unsent_tokens = 0
        self._sent_text = self._sent_text or bool(joined.text)
        return joined
