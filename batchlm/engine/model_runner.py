"""ModelRunner: SchedulerOutput -> ForwardBatch -> model -> one sampled token per finishing sequence."""

from __future__ import annotations

import torch

from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.sampling import Sampler, make_generator
from batchlm.engine.scheduler import SchedulerOutput
from batchlm.engine.sequence import Sequence
from batchlm.model.forward_batch import ForwardBatch
from batchlm.model.kv_cache import KVCache


class ModelRunner:
    """Runs one step of the model over the scheduled tokens; owns the Sampler.

    It reads sequences but never changes their bookkeeping (the scheduler's `update` does), except
    for creating a seeded sequence's RNG (`seq.rng`) the first time it is sampled.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, config: EngineConfig) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = kv_cache.block_size
        self.sampler = Sampler()

    def run(self, output: SchedulerOutput) -> dict[str, int]:
        """Forward the scheduled tokens; returns request id -> sampled token for every entry whose
        step reaches the end of its sequence (a prefill chunk that does not is not sampled)."""
        if output.is_empty:
            return {}
        batch = self.prepare(output)
        with torch.inference_mode():
            logits = self.model(batch, self.kv_cache)                       # (S, vocab)
            rows = [i for i, item in enumerate(output.scheduled) if item.samples]
            if not rows:
                return {}
            if len(rows) < logits.shape[0]:
                logits = logits[rows]                                       # (S', vocab)
            seqs = [output.scheduled[i].seq for i in rows]
            tokens = self.sampler.sample(
                logits, [s.params for s in seqs], [self._generator(s) for s in seqs])
        return {seq.request_id: token for seq, token in zip(seqs, tokens)}

    def prepare(self, output: SchedulerOutput) -> ForwardBatch:
        """Flatten the scheduled tokens of all sequences, then the padding rows, into one ForwardBatch."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        for item in output.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            table = seq.block_table
            input_ids += seq.token_ids(start, end)
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(item.num_tokens)
            context_lens.append(end)
            tables.append(table[:-(-end // bs)])
        for seq in output.padding:
            # NOTE: a padding row re-feeds its last cached token at its own position: the K/V it
            # writes are the ones already in that slot, so the row costs compute and changes nothing.
            pos = seq.num_computed_tokens - 1
            input_ids += seq.token_ids(pos, pos + 1)
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            query_lens.append(1)
            context_lens.append(pos + 1)
            tables.append(seq.block_table[:pos // bs + 1])
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        logits_indices, last = [], -1
        for n in query_lens:
            last += n
            logits_indices.append(last)
        return ForwardBatch(
            input_ids=self._tensor(input_ids),                              # (T,)
            positions=self._tensor(positions),                              # (T,)
            slot_mapping=self._tensor(slots),                               # (T,)
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=self._tensor(padded),                              # (S, max_blocks)
            logits_indices=self._tensor(logits_indices),                    # (S,)
        )

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.rng is None and seq.params.seed is not None:
            seq.rng = make_generator(seq.params.seed, self.config.device)
        return seq.rng
