"""A GGUF file's weights kept as the file stores them (Q4_0, Q4_1, Q8_0, F16, BF16), multiplied without a
float32 copy.

`load_quantized(model, weights)` gives every Linear whose tensors are all of one such type its blocks
(Linear.load_quantized: batchlm::linear_q, batchlm/kernels/linear_quant.cpp), and the token embedding a
lookup into them (QuantizedEmbedding: batchlm::embedding_q); the model's float32 copies of those weights are
dropped unfilled. A weight is dequantized in registers as the `gguf` package (and so transformers) reads
it, and every sum runs in batchlm::linear's order, so the model's outputs are bit-identical to the float32
model on the dequantized file, at a fraction of its memory (Q4_1: 5 bits a weight, Q8_0 8.5, F16 and BF16
16, against 32).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from batchlm import kernels
from batchlm.model.gguf_file import QUANTIZED_TYPES, GGUFWeights
from batchlm.model.model import Linear


class QuantizedEmbedding(nn.Module):
    """Token id -> its row of a packed (Linear.load_quantized) matrix, dequantized: (T,) -> (T, D) float32."""

    weight = None  # no dense table: LlamaForCausalLM.weight_plan skips it

    def __init__(self, packed: torch.Tensor, qtype: str) -> None:
        super().__init__()
        self.packed, self.qtype = packed, qtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchlm.embedding_q(self.packed, QUANTIZED_TYPES[self.qtype], ids.long())  # (T, D)


def can_hold_quantized(model: nn.Module) -> bool:
    """Whether the model's linears can run on GGUF blocks here: a float32 CPU model and batchlm::linear_q
    with vector code (kernels.linear_q_is_native)."""
    return model.device.type == "cpu" and model.dtype is torch.float32 and kernels.linear_q_is_native()


def load_quantized(model: nn.Module, weights: GGUFWeights) -> int:
    """Move every weight of `model` (a LlamaForCausalLM, before load_hf_state_dict) that the file holds in one
    of QUANTIZED_TYPES (rows of a multiple of 32 values) to its blocks; returns how many modules moved.
    Fused projections (q/k/v, gate/up) move only when all their tensors are of one type."""
    moved = 0
    for module, names in model.weight_plan():
        if not isinstance(module, Linear):
            continue
        parts = [weights.quantized(name) for name in names]
        if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
            continue
        raw = torch.cat([torch.from_numpy(p[1]) for p in parts])  # (out_features, blocks' bytes)
        module.load_quantized(parts[0][0], raw)
        moved += 1
    lm_head = model.lm_head
    if model.config.tie_word_embeddings and lm_head.backend == "quantized":
        model.embed_tokens = QuantizedEmbedding(lm_head.packed, lm_head.qtype)  # the same blocks, shared
        return moved + 1
    embedding = weights.quantized("model.embed_tokens.weight")
    if embedding is not None:
        qtype, raw = embedding
        model.embed_tokens = QuantizedEmbedding(
            torch.ops.batchlm.pack_linear_q(torch.from_numpy(raw), QUANTIZED_TYPES[qtype]), qtype)
        moved += 1
    return moved
