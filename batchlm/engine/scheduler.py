"""Scheduler: decides, each step, which sequences run and how many tokens each feeds.

Pure bookkeeping (no torch): it moves sequences between `waiting` and `running`, hands out KV blocks
through the BlockAllocator, and returns a typed SchedulerOutput. The model runner does the tensor work.

Policy, per step, under a token budget of `max_num_batched_tokens`:
1. running sequences first, in admission order: one decode token each, or the next prefill chunk;
   a sequence that needs a block when none is free preempts the most recently admitted running
   sequence (its blocks are freed, it goes back to the front of `waiting` and is recomputed later);
2. then waiting sequences, FIFO, while `len(running) < max_num_seqs`, the budget has room and free
   blocks cover what is scheduled. The head of the queue is never skipped, so nothing starves.
   With on-demand KV, admission also leaves `admit_headroom_blocks` free blocks per running sequence:
   admitting into the last free blocks only lets the running ones' growth preempt the newcomer a few
   steps later, and every preemption recomputes its whole context (`batchlm-bench sweep` with
   `--vary parameters.admit_headroom_blocks=0,2` shows the preemptions each value causes).
Finished and aborted sequences free their blocks at once, so a waiting one can run at the next step.

Prefix caching (`enable_prefix_caching`): each block a step fills is made findable by its tokens
(`_block_keys`); a sequence admitted later starts after its longest cached run of full blocks, which it
holds with whoever else does (the BlockAllocator counts holders and evicts released cached blocks, least
recently released first, only when it needs space). A preempted sequence finds its own blocks again if
they were not evicted meanwhile.

Request-level batching (RESERVE_FULL with `config.pad_finished_rows`): a finished sequence keeps its
blocks and rides along in every later forward pass as a padding row (`SchedulerOutput.padding`) until
no sequence of the batch is running, as fixed-shape batch tensors do; then all of them are freed.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from batchlm.engine.block_allocator import BlockAllocator
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sequence import FinishReason, Sequence, SequenceStatus
from batchlm.errors import InvalidArgument
from batchlm.response_schema import TokenLogprob


class KVPolicy(enum.Enum):
    ON_DEMAND = "on_demand"        # a block at a time as the sequence grows (continuous batching)
    RESERVE_FULL = "reserve_full"  # prompt + max_tokens at admission (request-level batching)


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_tokens: int       # tokens fed this step: 1 for decode, the chunk length for prefill
    samples: bool         # this step reaches the end of the sequence, so a token is sampled
    is_prefill: bool      # feeds prompt (or recomputed) tokens rather than one decode token


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    preempted: tuple[Sequence, ...]     # sent back to waiting this step (KV to be recomputed)
    padding: tuple[Sequence, ...] = ()  # finished rows computed as padding, outputs discarded

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def prefills(self) -> list[ScheduledSequence]:
        return [s for s in self.scheduled if s.is_prefill]

    @property
    def decodes(self) -> list[ScheduledSequence]:
        return [s for s in self.scheduled if not s.is_prefill]


class Scheduler:
    """Owns the waiting queue and the running list. One thread drives it (the engine's)."""

    def __init__(self, config: EngineConfig, allocator: BlockAllocator,
                 policy: KVPolicy = KVPolicy.ON_DEMAND) -> None:
        self.config = config
        self.allocator = allocator
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # in admission order
        self.padding: list[Sequence] = []          # finished rows kept as padding (request-level)
        self._pad = policy is KVPolicy.RESERVE_FULL and config.pad_finished_rows
        self._unfinished: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._caching = config.enable_prefix_caching
        self.prefix_cache_queries = 0              # prompt tokens of admitted sequences, first admission
        self.prefix_cache_hits = 0                 # of those, tokens whose K/V came from the cache

    # --- requests in and out ---
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raises InvalidArgument if it could never fit."""
        if seq.request_id in self._unfinished:
            raise InvalidArgument("request_id", f"{seq.request_id!r} is already in flight")
        check_fits(seq.num_prompt_tokens, seq.params.max_tokens, self.config.max_request_tokens)
        self.waiting.append(seq)
        self._unfinished[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel an unfinished sequence and free its blocks now; None if unknown or finished."""
        seq = self._unfinished.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finish(FinishReason.CANCELLED)
        self._release_padding_if_idle()
        return seq

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    # --- one step ---
    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch; allocates the blocks it needs (may preempt)."""
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        budget = self._schedule_running(scheduled, preempted, self.config.max_num_batched_tokens)
        if not preempted:  # NOTE: under block pressure, admitting more would only thrash
            self._admit_waiting(scheduled, budget)
        padding = tuple(self.padding) if scheduled else ()
        return SchedulerOutput(tuple(scheduled), tuple(preempted), padding)

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int],
               logprobs: Mapping[str, TokenLogprob] = MappingProxyType({}),
               prompt_logprobs: Mapping[str, list[TokenLogprob]] = MappingProxyType({})) -> list[Sequence]:
        """Record what the step computed; `sampled` maps request id -> token for every entry with
        `samples`, `logprobs` request id -> that token's log-probability where the request asks for it,
        `prompt_logprobs` request id -> its prompt tokens' that this step computed. Returns the sequences
        that got a token (finished ones included, already retired)."""
        updated = []
        for item in output.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted after schedule(): its blocks are already free
                continue
            seq.num_computed_tokens += item.num_tokens
            self._register_full_blocks(seq)
            if seq.request_id in prompt_logprobs:
                seq.add_prompt_logprobs(prompt_logprobs[seq.request_id])
            if item.samples:
                seq.append_token(sampled[seq.request_id], logprobs.get(seq.request_id))
                updated.append(seq)
                if seq.is_finished:
                    self.running.remove(seq)
                    self._retire(seq)
        self._release_padding_if_idle()
        return updated

    # --- helpers ---
    def _schedule_running(self, scheduled: list[ScheduledSequence], preempted: list[Sequence],
                          budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._grow(seq, n, preempted):
                break  # it preempted itself: nothing behind it is left in `running`
            scheduled.append(_entry(seq, n))
            budget -= n
            i += 1
        return budget

    def _grow(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Give `seq` the blocks for `num_tokens` more tokens, preempting from the back of
        `running` (never a sequence already scheduled this step). False if `seq` itself went."""
        need = self._blocks_for(seq.num_computed_tokens + num_tokens) - len(seq.block_table)
        while need > self.allocator.num_free:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _admit_waiting(self, scheduled: list[ScheduledSequence], budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            hit = self._cached_prefix(seq)
            cached = len(hit) * self.config.block_size
            uncomputed = seq.num_tokens - cached
            n = min(uncomputed, budget)
            if n < uncomputed and not self.config.enable_chunked_prefill:
                break
            if self.policy is KVPolicy.RESERVE_FULL:
                need = self._blocks_for(seq.num_prompt_tokens + seq.params.max_tokens) - len(hit)
                headroom = 0
            else:
                need = self._blocks_for(cached + n) - len(hit)
                headroom = self.config.admit_headroom_blocks * len(self.running)
            if need + headroom + self.allocator.num_evictable(hit) > self.allocator.num_free:
                break
            self.waiting.popleft()
            self.allocator.take(hit)
            seq.block_table = hit + self.allocator.allocate(need)
            seq.num_computed_tokens, seq.num_registered_blocks = cached, len(hit)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
                self.prefix_cache_queries += seq.num_prompt_tokens
                self.prefix_cache_hits += cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(_entry(seq, n))
            budget -= n

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` can start from: its longest run of full blocks whose K/V are cached,
        short of its last token (a step must compute at least one token, to have logits to sample).
        None for a request that scores its prompt: each prompt token's logits must be computed."""
        if not self._caching or seq.params.prompt_logprobs is not None:
            return []
        return self.allocator.cached_prefix(self._block_keys(seq, (seq.num_tokens - 1) // self.config.block_size))

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Make the blocks that the step filled findable by their tokens."""
        full = seq.num_computed_tokens // self.config.block_size
        if not self._caching or full <= seq.num_registered_blocks:
            return
        keys = self._block_keys(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.allocator.cache(seq.block_table[i], keys[i])
        seq.num_registered_blocks = full

    def _block_keys(self, seq: Sequence, num_blocks: int) -> list[tuple]:
        """The keys of the first `num_blocks` full blocks of `seq`: a block's key is its parent's key and
        its own token ids, so equal keys mean equal tokens from position 0 on, and so equal K/V."""
        keys, bs = seq.block_keys, self.config.block_size
        for i in range(len(keys), num_blocks):
            keys.append((keys[i - 1] if i else None, tuple(seq.token_ids(i * bs, (i + 1) * bs))))
        return keys[:num_blocks]

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _retire(self, seq: Sequence) -> None:
        """A sequence finished: free its blocks, or keep it as a padding row of its batch."""
        if not self._pad:
            self._release(seq)
            return
        self._unfinished.pop(seq.request_id, None)
        self.padding.append(seq)

    def _release_padding_if_idle(self) -> None:
        """The batch is over once nothing runs: its padding rows give their blocks back."""
        if self.running or not self.padding:
            return
        for seq in self.padding:
            self._free(seq)
        self.padding = []

    def _release(self, seq: Sequence) -> None:
        self._free(seq)
        self._unfinished.pop(seq.request_id, None)

    def _free(self, seq: Sequence) -> None:
        """Let go of the blocks of `seq`, last first: cached ones are then evicted tail first."""
        self.allocator.free(reversed(seq.block_table))
        seq.block_table = []

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)


def check_fits(num_prompt_tokens: int, max_tokens: int, limit: int) -> None:
    """The rule of a request's size, for every engine: raise InvalidArgument unless its prompt is not
    empty and prompt + max_tokens fits in `limit` tokens (batchlm's engine: `EngineConfig.max_request_tokens`,
    its context and its KV reservation; the TensorRT-LLM front: its `max_model_len`). The prompt is
    named `prompt`; the Triton side names it as its input (`triton_io.check_fits`)."""
    if num_prompt_tokens == 0:
        raise InvalidArgument("prompt", "is empty")
    if num_prompt_tokens > limit:
        raise InvalidArgument("prompt", f"{num_prompt_tokens} tokens exceed the limit of {limit}")
    if num_prompt_tokens + max_tokens > limit:
        raise InvalidArgument(
            "max_tokens", f"prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) exceed the "
            f"limit of {limit} tokens")


def _entry(seq: Sequence, num_tokens: int) -> ScheduledSequence:
    return ScheduledSequence(
        seq=seq, num_tokens=num_tokens,
        samples=num_tokens == seq.num_uncomputed_tokens,
        is_prefill=num_tokens > 1 or not seq.is_prefill_done)
