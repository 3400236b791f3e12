"""ModelRunner: SchedulerOutput -> ForwardBatch -> model -> one sampled token per finishing sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchlm.engine.engine_config import EngineConfig
from batchlm.engine.guided_decoding import apply_guides
from batchlm.engine.logits_shaping import shape_logits
from batchlm.engine.logprobs import token_logprobs
from batchlm.engine.sampling import Sampler, make_generator
from batchlm.engine.scheduler import SchedulerOutput
from batchlm.engine.sequence import Sequence
from batchlm.model.forward_batch import ForwardBatch
from batchlm.model.kv_cache import KVCache
from batchlm.response_schema import TokenLogprob


@dataclass(frozen=True)
class StepResult:
    """What one step computed, by request id."""

    tokens: dict[str, int] = field(default_factory=dict)  # the sampled token of every entry that samples
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # its log-probability, where asked for
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # prompt tokens' this step


class ModelRunner:
    """Runs one step of the model over the scheduled tokens; owns the Sampler.

    It reads sequences but never changes their bookkeeping (the scheduler's `update` does), except
    for creating a seeded sequence's RNG (`seq.rng`) the first time it is sampled and advancing a guided
    sequence's matcher (`seq.guide`) by the token it samples.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, config: EngineConfig) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = kv_cache.block_size
        self.sampler = Sampler()

    def run(self, output: SchedulerOutput) -> StepResult:
        """Forward the scheduled tokens; samples a token for every entry whose step reaches the end of
        its sequence (a prefill chunk that does not is not sampled), with the log-probabilities its
        request asks for."""
        if output.is_empty:
            return StepResult()
        rows = [logit_positions(item.seq, item.num_tokens) for item in output.scheduled]
        batch = self.prepare(output, rows)
        sample_rows, seqs, prompt_rows = [], [], {}
        r = 0
        for item, positions in zip(output.scheduled, rows):
            if item.samples:
                sample_rows.append(r + len(positions) - 1)
                seqs.append(item.seq)
            if item.seq.wants_prompt_logprobs:
                scored = len(item.seq.prompt_logprobs)
                prompt_rows[item.seq] = [(r + i, p) for i, p in enumerate(positions)
                                         if scored <= p < item.seq.num_prompt_tokens - 1]
            r += len(positions)
        with torch.inference_mode():
            logits = self.model(batch, self.kv_cache)                       # (R, vocab)
            result = StepResult(prompt_logprobs={seq.request_id: _prompt_logprobs(logits, seq, at)
                                                 for seq, at in prompt_rows.items() if at})
            if not seqs:
                return result
            picked = logits[sample_rows] if len(sample_rows) < logits.shape[0] else logits  # (S', vocab)
            guides = [s.guide for s in seqs]
            tokens = self.sampler.sample(apply_guides(picked, shape_logits(picked, seqs), guides),
                                         [s.params for s in seqs], [self._generator(s) for s in seqs])
            for guide, token in zip(guides, tokens):
                if guide is not None:
                    guide.take(token)
            result.tokens.update((seq.request_id, token) for seq, token in zip(seqs, tokens))
            asking = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
            if asking:
                logprobs = token_logprobs(picked[asking], [tokens[i] for i in asking],
                                          [seqs[i].params.logprobs for i in asking])
                result.logprobs.update((seqs[i].request_id, lp) for i, lp in zip(asking, logprobs))
        return result

    def prepare(self, output: SchedulerOutput, rows: list[list[int]] | None = None) -> ForwardBatch:
        """Flatten the scheduled tokens of all sequences, then the padding rows, into one ForwardBatch.
        `rows`: per scheduled entry, the positions whose logits the step returns, ascending, its last
        scheduled token last (`logit_positions`); by default that token alone."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        for i, item in enumerate(output.scheduled):
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            table = seq.block_table
            logits_indices += [len(input_ids) + p - start for p in (rows[i] if rows else (end - 1,))]
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
            logits_indices.append(len(input_ids))
            input_ids += seq.token_ids(pos, pos + 1)
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            query_lens.append(1)
            context_lens.append(pos + 1)
            tables.append(seq.block_table[:pos // bs + 1])
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return ForwardBatch(
            input_ids=self._tensor(input_ids),                              # (T,)
            positions=self._tensor(positions),                              # (T,)
            slot_mapping=self._tensor(slots),                               # (T,)
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=self._tensor(padded),                              # (S, max_blocks)
            logits_indices=self._tensor(logits_indices),                    # (R,)
        )

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.rng is None and seq.params.seed is not None:
            seq.rng = make_generator(seq.params.seed, self.config.device)
        return seq.rng


def logit_positions(seq: Sequence, num_tokens: int) -> list[int]:
    """The positions of a step of `num_tokens` tokens of `seq` whose logits the step needs, ascending:
    its last token's, and, while its prompt's log-probabilities are asked for, those of the positions
    whose next token is a prompt token not yet scored (a position's logits score the token after it)."""
    start = seq.num_computed_tokens
    end = start + num_tokens
    if not seq.wants_prompt_logprobs:
        return [end - 1]
    scored = range(max(start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1))
    return [*scored, end - 1] if end - 1 not in scored else list(scored)


def _prompt_logprobs(logits: torch.Tensor, seq: Sequence, at: list[tuple[int, int]]) -> list[TokenLogprob]:
    """The log-probabilities of the prompt tokens after positions `at` ((row of logits, position) each)."""
    return token_logprobs(logits[[r for r, _ in at]], [seq.prompt_ids[p + 1] for _, p in at],
                          [seq.params.prompt_logprobs] * len(at))
