"""RequestOutput: what one engine step reports for one request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

from batchlm.engine.sequence import FinishReason, Sequence
from batchlm.response_schema import TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    text: str                              # new text since this request's previous output
    token_ids: list[int]                   # new token ids since the previous output
    finished: bool
    finish_reason: FinishReason | None     # set only when finished
    num_prompt_tokens: int
    num_output_tokens: int                 # generated so far, in total
    logprobs: list[TokenLogprob] | None = None         # one per token id, with params.logprobs
    prompt_ids: list[int] | None = None                # with prompt_logprobs, once, when all are known
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt id but the first
    num_cached_tokens: int = 0                         # prompt tokens whose K/V came from the prefix cache

    @classmethod
    def take(cls, seq: Sequence) -> RequestOutput:
        """The delta of `seq` since the last call (consumes the text, ids and log-probabilities it reports)."""
        token_ids, logprobs = seq.take_new_tokens()
        prompt_logprobs = seq.take_prompt_logprobs()
        return cls(request_id=seq.request_id, text=seq.take_new_text(),
                   token_ids=token_ids, finished=seq.is_finished,
                   finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
                   num_output_tokens=seq.num_output_tokens, logprobs=logprobs,
                   prompt_ids=None if prompt_logprobs is None else list(seq.prompt_ids),
                   prompt_logprobs=prompt_logprobs, num_cached_tokens=seq.num_cached_tokens or 0)

    @classmethod
    def concat(cls, parts: Seq[RequestOutput]) -> RequestOutput:
        """Join one request's successive outputs into one (the whole text, all ids and log-probabilities)."""
        last = parts[-1]
        logprobs = None if all(p.logprobs is None for p in parts) else [
            t for p in parts for t in (p.logprobs or ())]
        prompt = next((p for p in parts if p.prompt_logprobs is not None), None)
        return cls(request_id=last.request_id, text="".join(p.text for p in parts),
                   token_ids=[t for p in parts for t in p.token_ids], finished=last.finished,
                   finish_reason=last.finish_reason, num_prompt_tokens=last.num_prompt_tokens,
                   num_output_tokens=last.num_output_tokens, logprobs=logprobs,
                   prompt_ids=None if prompt is None else prompt.prompt_ids,
                   prompt_logprobs=None if prompt is None else prompt.prompt_logprobs,
                   num_cached_tokens=last.num_cached_tokens)
