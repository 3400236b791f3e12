"""Sequence: one request inside the engine: status, token ids, block table, text and stop checks.

Lifecycle: WAITING -> RUNNING -> FINISHED, and RUNNING -> WAITING again when the scheduler preempts
it (its KV is dropped and recomputed later; its output so far is kept).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Iterable, Protocol

from batchlm.response_schema import TokenLogprob

if TYPE_CHECKING:  # NOTE: keeps sequence (and so the scheduler) free of torch at import time
    from batchlm.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"           # max_tokens generated
    STOP = "stop"               # EOS or a stop string
    CANCELLED = "cancelled"     # aborted by the client or the server


class Detokenizer(Protocol):
    """What Sequence needs from batchlm.model.tokenizer.IncrementalDetokenizer."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class Sequence:
    """A request's token ids and KV bookkeeping. The scheduler mutates it; nothing else does.

    Text: `append_token` grows the output text; `take_new_text` hands out only text that can no
    longer turn into a stop string: while unfinished it holds back `len(longest stop) - 1` chars.
    """

    def __init__(self, request_id: str, prompt_ids: Iterable[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(),
                 detokenizer: Detokenizer | None = None) -> None:
        self.request_id = request_id
        self.prompt_ids: list[int] = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []  # one per output id, with params.logprobs
        self.prompt_logprobs: list[TokenLogprob] = []  # prompt ids 1, 2, ... so far, with params.prompt_logprobs
        self.block_table: list[int] = []       # KV block ids, in position order
        self.num_computed_tokens = 0           # tokens whose K/V are in the cache
        self.block_keys: list[tuple] = []      # prefix-cache key of each full block so far (the scheduler's)
        self.num_registered_blocks = 0         # leading blocks of block_table made findable in the cache
        self.num_cached_tokens: int | None = None  # prompt tokens found in the cache at its first admission
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.rng: Any = None                   # sampler state (a torch.Generator), owned by the runner
        self.guide: Any = None                 # a GuideMatcher for a guided request, advanced by the runner
        self._eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._detokenizer = detokenizer
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._text = ""
        self._num_text_taken = 0
        self._num_ids_taken = 0
        self._prompt_logprobs_taken = False

    # --- derived counters ---
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to feed before the next token can be sampled (1 in steady decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end this sequence (none under ignore_eos)."""
        return self._eos

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def text(self) -> str:
        """All output text so far (cut before a stop string), including held-back text."""
        return self._text

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    # --- state changes ---
    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities are asked for and some are still to compute."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Add a sampled token (and its log-probability, where asked for) and finish the sequence if a
        stop condition holds."""
        self.output_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if token_id in self._eos:
            self.finish(FinishReason.STOP)          # NOTE: EOS is in token_ids but not in the text
            return
        if self._detokenizer is not None:
            before = len(self._text)
            self._text += self._detokenizer.add(token_id)
            # NOTE: a stop string completed before min_tokens stays in the text and is never found again
            if len(self.output_ids) >= self.params.min_tokens and self._cut_at_stop(before):
                self._set_finished(FinishReason.STOP)
                return
        if self.guide is not None and self.guide.is_done():
            self.finish(FinishReason.STOP)
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason) -> None:
        """Mark finished; releases text held back by the detokenizer (a stop string may still
        complete in it, which turns the reason into STOP)."""
        if self.is_finished:
            return
        if self._detokenizer is not None:
            before = len(self._text)
            self._text += self._detokenizer.flush()
            if self._cut_at_stop(before) and reason is FinishReason.LENGTH:
                reason = FinishReason.STOP
        self._set_finished(reason)

    def reset_for_recompute(self) -> None:
        """Preempted: the caller freed the blocks; the KV is recomputed when it runs again."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        self.status = SequenceStatus.WAITING

    def take_new_text(self) -> str:
        """Text not handed out before that can no longer become part of a stop string."""
        limit = len(self._text) if self.is_finished else len(self._text) - self._hold
        if limit <= self._num_text_taken:
            return ""
        piece = self._text[self._num_text_taken:limit]
        self._num_text_taken = limit
        return piece

    def add_prompt_logprobs(self, logprobs: list[TokenLogprob]) -> None:
        """Record the log-probabilities of the next prompt tokens (a prefill chunk's); those of tokens
        recomputed after a preemption are already here and are not passed again."""
        self.prompt_logprobs += logprobs

    def take_new_tokens(self) -> tuple[list[int], list[TokenLogprob] | None]:
        """The output ids not handed out before, and their log-probabilities (None if not asked for)."""
        start, self._num_ids_taken = self._num_ids_taken, len(self.output_ids)
        logprobs = self.output_logprobs[start:] if self.params.logprobs is not None else None
        return self.output_ids[start:], logprobs

    def take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt's log-probabilities, once, when all are known; None before, after, or if not asked for."""
        if (self.params.prompt_logprobs is None or self._prompt_logprobs_taken
                or len(self.prompt_logprobs) < self.num_prompt_tokens - 1):
            return None
        self._prompt_logprobs_taken = True
        return self.prompt_logprobs

    def _set_finished(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def _cut_at_stop(self, scanned: int) -> bool:
        """Truncate the text before the earliest stop string that ends after `scanned`."""
        if not self.params.stop:
            return False
        start = max(0, scanned - self._hold)
        hits = [i for i in (self._text.find(s, start) for s in self.params.stop) if i >= 0]
        if not hits:
            return False
        self._text = self._text[:min(hits)]
        return True

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)})")
