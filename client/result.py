"""What a finished request gives the caller (Result), built from the model's responses (collect), and
the error a failed request raises (RequestFailed)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from batchlm.response_schema import Chunk, TokenLogprob


class RequestFailed(RuntimeError):
    """The server answered with an error; `status` is the HTTP status or gRPC status name."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message



@dataclass
class Result:
    """A finished request: the whole text, counters (None where the model has none) and client-side
    timings (seconds)."""

    text: str
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int | None
    ttft: float  # time to the first response carrying text (whole answer when not streaming)
    latency: float  # end to end
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk, from the start
    token_ids: list[int] | None = None             # the ids of `text`; None where the model has no such output
    logprobs: list[TokenLogprob] | None = None     # one per token id, with the request's `logprobs`
    prompt_ids: list[int] | None = None            # with `prompt_logprobs`
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt id but the first
    num_cached_tokens: int | None = None           # prompt tokens whose KV came from the prefix cache


def collect(chunks: Iterator[Chunk], start: float | None = None) -> Result:
    """Drain a chunk stream (or the one chunk of a whole answer) into a Result with client-side timings."""
    start = time.perf_counter() if start is None else start
    times, seen = [], []
    ttft = None
    for chunk in chunks:
        now = time.perf_counter() - start
        times.append(now)
        if ttft is None and chunk.text:
            ttft = now
        seen.append(chunk)
    if not seen:
        raise RequestFailed("empty", "the stream ended without a response")
    latency = time.perf_counter() - start
    whole = Chunk.joined(seen)
    return Result(whole.text, whole.finish_reason, whole.num_input_tokens, whole.num_output_tokens,
                  ttft=latency if ttft is None else ttft, latency=latency, chunk_times=times,
                  token_ids=_listed(whole.token_ids), logprobs=_listed(whole.logprobs),
                  prompt_ids=_listed(whole.prompt_ids), prompt_logprobs=_listed(whole.prompt_logprobs),
                  num_cached_tokens=whole.num_cached_tokens)


def _listed(items: tuple | None) -> list | None:
    return None if items is None else list(items)
