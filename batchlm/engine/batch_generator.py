"""BatchGenerator: request-level batching (the static and dynamic strategies).

A batch is fixed when it starts: every row gets `prompt + max_tokens` KV blocks up front, rows are
prefilled, then decoded together until the last one finishes; finished rows leave the forward pass
but their answers wait for the whole batch. It drives the same engine loop as continuous batching,
with the scheduler's RESERVE_FULL policy and no request admitted after the batch starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence as Seq

import torch

from batchlm.engine.engine import CancelledRows, LLMEngine, OnStep, Prompt, load_parts
from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.request_output import RequestOutput
from batchlm.engine.sampling import SamplingParams
from batchlm.engine.scheduler import KVPolicy
from batchlm.errors import InvalidArgument
from batchlm.model.tokenizer import Tokenizer


class BatchGenerator:
    """Runs one batch at a time to completion. One thread at a time may call `generate`."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer,
                 config: EngineConfig = EngineConfig()) -> None:
        self._engine = LLMEngine.from_parts(model, tokenizer, config, KVPolicy.RESERVE_FULL)
        self.config = config

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: EngineConfig = EngineConfig()) -> BatchGenerator:
        model, tokenizer = load_parts(model_dir, config)
        return cls(model, tokenizer, config)

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    def kv_usage(self) -> tuple[int, int]:
        """(KV blocks used, KV blocks in total); a snapshot that any thread may read for metrics."""
        allocator = self._engine.allocator
        return allocator.num_used, allocator.num_total

    def generate(self, rows: Seq[tuple[Prompt, SamplingParams]],
                 on_step: OnStep | None = None,
                 cancelled_rows: CancelledRows | None = None) -> list[RequestOutput]:
        """One output per row (whole text, all ids), in row order, all returned together.

        Raises InvalidArgument if a row is bad, if there are more rows than `max_num_seqs`, or if
        the rows' `prompt + max_tokens` do not all fit in the KV cache at once. `on_step(num_seqs,
        new_tokens)` is called after every step. Rows that `cancelled_rows()` names after a step leave
        the batch (finish reason CANCELLED; see `LLMEngine.generate`); the rest run on unchanged.
        """
        if not rows:
            return []
        if len(rows) > self.config.max_num_seqs:
            raise InvalidArgument(
                "batch", f"{len(rows)} rows exceed max_num_seqs={self.config.max_num_seqs}")
        ids = [self._engine.check_fits(prompt, params) for prompt, params in rows]
        params = [p for _, p in rows]
        bs = self.config.block_size
        need = sum(-(-(len(i) + p.max_tokens) // bs) for i, p in zip(ids, params))
        if need > self.config.num_kv_blocks:
            raise InvalidArgument(
                "batch", f"prompt + max_tokens of all rows need {need} KV blocks, "
                f"the cache has {self.config.num_kv_blocks}")
        return self._engine.generate(ids, params, on_step, cancelled_rows)
