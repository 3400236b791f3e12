"""A GGUF file's weights kept as the file stores them (Q4_0, Q4_1, Q8_0, F16, BF16), multiplied without a
float32 copy.

`load_quantized(model, weights)` gives every Linear whose tensors are all of one such type its blocks
(Linear.set_packed: batchlm::linear_q, batchlm/kernels/linear_quant.cpp), and the token embedding a
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
from batchlm.model.shared_pack import SharedPack


class QuantizedEmbedding(nn.Module):
    """Token id -> its row of a packed (Linear.set_packed) matrix, dequantized: (T,) -> (T, D) float32."""

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


def load_quantized(model: nn.Module, weights: GGUFWeights, share: bool = True) -> int:
    """Move every weight of `model` (a LlamaForCausalLM, before load_hf_state_dict) that the file holds in one
    of QUANTIZED_TYPES (rows of a multiple of 32 values) to its blocks; returns how many modules moved.
    Fused projections (q/k/v, gate/up) move only when all their tensors are of one type.

    With `share`, the packed blocks are written once beside the file (SharedPack) and every process maps
    that copy read-only, so the models of one server hold the weights once in memory."""
    targets = _targets(model, weights)
    if not targets:  # nothing the file holds in a kept type (an F32 file, say)
        return 0
    packed = SharedPack(weights.path, targets).load(lambda: _pack(weights, targets)) if share else None
    if packed is None:
        packed = _pack(weights, targets)
    for (module, qtype, _), blocks in zip(targets, packed):
        if isinstance(module, Linear):
            module.set_packed(qtype, blocks)
        else:
            model.embed_tokens = QuantizedEmbedding(blocks, qtype)
    if model.config.tie_word_embeddings and model.lm_head.backend == "quantized":
        model.embed_tokens = QuantizedEmbedding(model.lm_head.packed, model.lm_head.qtype)  # the same blocks
        return len(targets) + 1
    return len(targets)


Target = tuple[nn.Module, str, tuple[str, ...]]  # (Linear or the embedding, GGUF type, HF tensor names)


def _targets(model: nn.Module, weights: GGUFWeights) -> list[Target]:
    """What moves: each Linear whose tensors are all of one kept type, and an untied embedding of one."""
    targets: list[Target] = []
    for module, names in model.weight_plan():
        types = {weights.kept_type(name) for name in names}
        if isinstance(module, Linear) and len(types) == 1 and None not in types:
            targets.append((module, types.pop(), names))
    embedding = "model.embed_tokens.weight"
    qtype = weights.kept_type(embedding)
    if qtype is not None and not model.config.tie_word_embeddings:
        targets.append((model.embed_tokens, qtype, (embedding,)))
    return targets


def _pack(weights: GGUFWeights, targets: list[Target]) -> list[torch.Tensor]:
    packed = []
    for _, qtype, names in targets:
        raw = torch.cat([torch.from_numpy(weights.quantized(name)[1]) for name in names])  # (N, blocks' bytes)
        packed.append(torch.ops.batchlm.pack_linear_q(raw, QUANTIZED_TYPES[qtype]))
    return packed
