"""ForwardBatch: everything one forward pass needs, for a ragged mix of prefill chunks and decode tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """The tensors of one model step; built by the ModelRunner, read by LlamaForCausalLM.forward.

    Tokens of all S sequences are flattened, sequence after sequence, into T = sum(query_lens) rows.
    A sequence contributes either a prefill chunk (query_len >= 1 prompt tokens) or one decode token.

    Invariants the model relies on:
    - len(query_lens) == len(context_lens) == block_tables.shape[0] == S;
    - logits_indices holds each sequence's last token, in sequence order, and may hold earlier rows too;
    - query_lens[i] <= context_lens[i]; the first context_lens[i] - query_lens[i] tokens of sequence i
      are already in the KV cache, in the slots its block table names;
    - slot_mapping[t] = block * block_size + offset for token t's absolute position, inside its own blocks;
    - block_tables[i] covers context_lens[i] tokens; padding entries (0) are never read unmasked.
    """

    input_ids: torch.Tensor  # (T,) int64: tokens scheduled this step, sequence after sequence
    positions: torch.Tensor  # (T,) int64: absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) int64: KV slot each token's K/V is written to
    query_lens: list[int]  # (S) tokens scheduled per sequence (1 for decode, chunk length for prefill)
    context_lens: list[int]  # (S) tokens in the cache for the sequence after this step (cached + query_len)
    block_tables: torch.Tensor  # (S, max_blocks) int64: block ids of each sequence, right-padded with 0
    logits_indices: torch.Tensor  # (R,) int64, ascending: rows of T whose logits are returned, R >= S

    @property
    def num_tokens(self) -> int:
        """T: tokens in this step."""
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        """S: sequences in this step."""
        return len(self.query_lens)
