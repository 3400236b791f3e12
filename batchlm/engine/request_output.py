"""RequestOutput: what one engine step reports for one request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

from batchlm.engine.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    text: str                              # new text since this request's previous output
    token_ids: list[int]                   # new token ids since the previous output
    finished: bool
    finish_reason: FinishReason | None     # set only when finished
    num_prompt_tokens: int
    num_output_tokens: int                 # generated so far, in total

    @classmethod
    def take(cls, seq: Sequence) -> RequestOutput:
        """The delta of `seq` since the last call (consumes the text and ids it reports)."""
        return cls(request_id=seq.request_id, text=seq.take_new_text(),
                   token_ids=seq.take_new_token_ids(), finished=seq.is_finished,
                   finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
                   num_output_tokens=seq.num_output_tokens)

    @classmethod
    def concat(cls, parts: Seq[RequestOutput]) -> RequestOutput:
        """Join one request's successive outputs into one (the whole text and all ids)."""
        last = parts[-1]
        return cls(request_id=last.request_id, text="".join(p.text for p in parts),
                   token_ids=[t for p in parts for t in p.token_ids], finished=last.finished,
                   finish_reason=last.finish_reason, num_prompt_tokens=last.num_prompt_tokens,
                   num_output_tokens=last.num_output_tokens)
