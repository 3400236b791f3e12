"""What a request's parameters do to its logits before it samples: logit_bias, min_tokens, then the
repetition, frequency and presence penalties (vLLM's order), row by row.

Each row is changed on its own, from its own sequence's ids, so a request's tokens do not depend on the
other rows of the step. Log-probabilities are taken before any of this (batchlm.engine.logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from batchlm.engine.sequence import Sequence


def shape_logits(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """logits (S, V), row i sampled for seqs[i] -> the logits to sample from: the same tensor when no
    request shapes its logits, else a copy with those rows changed."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.shapes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        _shape_row(logits[i], seqs[i])
    return logits


def _shape_row(row: torch.Tensor, seq: Sequence) -> None:
    """Change one row (V,) in place."""
    params, device = seq.params, row.device
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
        row.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=row.dtype, device=device))
    if seq.num_output_tokens < params.min_tokens and seq.eos_token_ids:
        row[list(seq.eos_token_ids)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(seq.prompt_ids + seq.output_ids, device=device).unique()
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and seq.output_ids:
        ids, counts = torch.tensor(seq.output_ids, device=device).unique(return_counts=True)
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
