"""The responses every model sends, read back: `Chunk` (one response), `TokenLogprob` (a token's
log-probability and its likeliest alternatives) and `logprob_outputs` (the arrays that carry them). The
outputs themselves are declared with the inputs, in batchlm.request_schema.OUTPUTS. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability given every token before it, and the most likely tokens in its place."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (id, log p), most likely first


def logprob_outputs(prefix: str, ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> dict[str, np.ndarray]:
    """The output arrays of `ids` and their log-probabilities, by name: `{prefix}_ids`, and with `logprobs`
    `{prefix}_log_probs` and, where they hold alternatives, `{prefix}_top_ids` and `{prefix}_top_log_probs`
    (prefix "output" or "prompt"; `logprobs` is one per id, or one per id but the first for a prompt)."""
    arrays = {f"{prefix}_ids": np.array(ids, dtype=np.int32)}
    if logprobs is None:
        return arrays
    arrays[f"{prefix}_log_probs"] = np.array([t.logprob for t in logprobs], dtype=np.float32)
    if any(t.top for t in logprobs):
        arrays[f"{prefix}_top_ids"] = np.array([i for t in logprobs for i, _ in t.top], dtype=np.int32)
        arrays[f"{prefix}_top_log_probs"] = np.array([p for t in logprobs for _, p in t.top], dtype=np.float32)
    return arrays


class MalformedResponse(ValueError):
    """A model's response lacks what every response carries (`text_output`)."""


@dataclass(frozen=True)
class Chunk:
    """One response of a model: new text (a delta when streaming) and the model's counters; with the
    request's `logprobs` and `prompt_logprobs`, the log-probabilities of its tokens."""

    text: str
    finish_reason: str | None        # "" on a response that does not end the request; None: no such output
    num_input_tokens: int | None     # None where the model has no such output
    num_output_tokens: int | None
    token_ids: tuple[int, ...] | None = None           # the ids `text` holds; None where the model has no such output
    logprobs: tuple[TokenLogprob, ...] | None = None   # one per token id, with `logprobs`
    prompt_ids: tuple[int, ...] | None = None          # with `prompt_logprobs`, on the first response
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # one per prompt id but the first
    num_cached_tokens: int | None = None                # None where the model has no such output

    @classmethod
    def from_outputs(cls, output: Callable[[str], object]) -> Chunk:
        """The Chunk of one response; `output(name)` gives the named output as an array (gRPC's
        `InferResult.as_numpy`), a JSON value, scalar or nested lists (`/generate`'s body, `/infer`'s
        `outputs`' data), or None where the response has none.

        Raises:
            MalformedResponse: the response has no `text_output`, or log-probabilities that do not match
                their ids.
        """
        def first(name: str):
            value = output(name)
            if isinstance(value, np.ndarray):
                value = value.reshape(-1)[:1].tolist()
            while isinstance(value, list):
                value = value[0] if value else None
            return value

        text, reason, num_in, num_out, num_cached = (first(name) for name in (
            "text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "num_cached_tokens"))
        if text is None:
            raise MalformedResponse("the response has no text_output")
        token_ids, logprobs = _logprobs_of(output, "output", 0)
        prompt_ids, prompt_logprobs = _logprobs_of(output, "prompt", 1)
        return cls(text=_str(text), finish_reason=None if reason is None else _str(reason),
                   num_input_tokens=None if num_in is None else int(num_in),
                   num_output_tokens=None if num_out is None else int(num_out),
                   token_ids=token_ids, logprobs=logprobs, prompt_ids=prompt_ids, prompt_logprobs=prompt_logprobs,
                   num_cached_tokens=None if num_cached is None else int(num_cached))

    @classmethod
    def joined(cls, chunks: Sequence[Chunk]) -> Chunk:
        """One Chunk for one request's Chunks (a stream's): their text and tokens in order, the prompt's
        tokens of the first that has them, the last one's finish reason and counters."""
        def run(parts: list[tuple | None]) -> tuple | None:
            present = [p for p in parts if p is not None]
            return tuple(x for p in present for x in p) if present else None

        last = chunks[-1]
        prompt = next((c for c in chunks if c.prompt_ids is not None), last)
        # NOTE: tokens of one Chunk without their log-probabilities leave the whole without any, which a
        # caller that asked for them can refuse, rather than a list short of some
        unscored = any(c.token_ids and c.logprobs is None for c in chunks)
        return cls("".join(c.text for c in chunks), last.finish_reason, last.num_input_tokens,
                   last.num_output_tokens, token_ids=run([c.token_ids for c in chunks]),
                   logprobs=None if unscored else run([c.logprobs for c in chunks]),
                   prompt_ids=prompt.prompt_ids, prompt_logprobs=prompt.prompt_logprobs,
                   num_cached_tokens=last.num_cached_tokens)


def _logprobs_of(output: Callable[[str], object], prefix: str, skip: int):
    """(ids, their TokenLogprobs) of logprob_outputs' arrays, read back; `skip` ids have no log-probability."""
    def flat(name: str) -> list | None:
        value = output(f"{prefix}_{name}")
        return None if value is None else np.asarray(value).reshape(-1).tolist()

    ids, logprobs, top_ids, top_logprobs = (flat(n) for n in ("ids", "log_probs", "top_ids", "top_log_probs"))
    if ids is None:
        return None, None
    ids = tuple(int(i) for i in ids)
    if logprobs is None:
        return ids, None
    n = len(ids) - skip if ids else 0
    top_ids, top_logprobs = top_ids or [], top_logprobs or []
    if len(logprobs) != n or len(top_ids) != len(top_logprobs) or (n and len(top_ids) % n) or (top_ids and not n):
        raise MalformedResponse(f"{prefix}_log_probs does not match {prefix}_ids")
    width = len(top_ids) // n if n else 0
    rows = [tuple(zip((int(i) for i in top_ids[r * width:(r + 1) * width]),
                      (float(p) for p in top_logprobs[r * width:(r + 1) * width]))) for r in range(n)]
    return ids, tuple(TokenLogprob(ids[skip + r], float(logprobs[r]), rows[r]) for r in range(n))


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
