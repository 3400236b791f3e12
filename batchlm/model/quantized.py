"""A GGUF file's weights kept as the file stores them (Q4_0, Q4_1, Q8_0, F16, BF16), multiplied without a
float32 copy.

`load_quantized(model, weights)` gives every Linear whose tensors are all of one such type its blocks
(Linear.set_packed: batchlm::linear_q, batchlm/kernels/linear_quant.cpp), and the token embedding a
lookup into them (QuantizedEmbedding: batchlm::embedding_q); the model's float32 copies of those weights are
dropped unfilled. A weight is dequantized in registers as the `gguf` package (and so transformers) reads
it, and every sum runs in batchlm::linear's order, so the model's outputs are bit-identical to the float32
model on the dequantized file, at a fraction of its memory (Q4_1: 5 bits a weight, Q8_0 8.5, F16 and BF16
16, against 32).

With `activations="int8"` the Q4_0, Q4_1 and Q8_0 tensors are packed for batchlm::linear_q8
(batchlm/kernels/linear_int8.cpp) instead, which rounds each row of activations to int8 per block of 32 and
multiplies in integers: faster, not exact (docs/benchmarking.md gives its agreement with the exact model),
still batch-invariant. F16 and BF16 tensors stay on linear_q.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from batchlm import kernels
from batchlm.model.gguf_file import QUANTIZED_TYPES, GGUFWeights
from batchlm.model.model import Linear
from batchlm.model.shared_pack import SharedPack

log = logging.getLogger(__name__)

INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the types batchlm::linear_q8 multiplies


class QuantizedEmbedding(nn.Module):
    """Token id -> its row of a packed (Linear.set_packed) matrix, dequantized: (T,) -> (T, D) float32. The
    same values from either layout (`int8`: pack_linear_q8's)."""

    weight = None  # no dense table: LlamaForCausalLM.weight_plan skips it

    def __init__(self, packed: torch.Tensor, qtype: str, int8: bool = False) -> None:
        super().__init__()
        self.packed, self.qtype = packed, qtype
        self.lookup = torch.ops.batchlm.embedding_q8 if int8 else torch.ops.batchlm.embedding_q

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(self.packed, QUANTIZED_TYPES[self.qtype], ids.long())  # (T, D)


def can_hold_quantized(model: nn.Module) -> bool:
    """Whether the model's linears can run on GGUF blocks here: a float32 CPU model and batchlm::linear_q
    with vector code (kernels.linear_q_is_native)."""
    return model.device.type == "cpu" and model.dtype is torch.float32 and kernels.linear_q_is_native()


def load_quantized(model: nn.Module, weights: GGUFWeights, share: bool = True, activations: str = "float32") -> int:
    """Move every weight of `model` (a LlamaForCausalLM, before load_hf_state_dict) that the file holds in one
    of QUANTIZED_TYPES (rows of a multiple of 32 values) to its blocks; returns how many modules moved.
    Fused projections (q/k/v, gate/up) move only when all their tensors are of one type.

    With `share`, the packed blocks are written once beside the file (SharedPack) and every process maps
    that copy read-only, so the models of one server hold the weights once in memory.

    `activations` "int8" packs the Q4_0, Q4_1 and Q8_0 tensors for batchlm::linear_q8 (module docstring);
    where that op has no vector code here it warns and keeps float32 activations."""
    targets = _targets(model, weights)
    if not targets:  # nothing the file holds in a kept type (an F32 file, say)
        return 0
    if activations == "int8" and not kernels.linear_q8_is_native():
        log.warning("activations int8: batchlm::linear_q8 has no vector code here (needs AVX2); using float32")
        activations = "float32"
    int8 = [activations == "int8" and qtype in INT8_TYPES for _, qtype, _ in targets]
    layouts = ["int8" if i else "float32" for i in int8]
    packed = SharedPack(weights.path, targets, layouts).load(lambda: _pack(weights, targets, int8)) if share else None
    if packed is None:
        packed = _pack(weights, targets, int8)
    for (module, qtype, _), blocks, i in zip(targets, packed, int8):
        if isinstance(module, Linear):
            module.set_packed(qtype, blocks, int8=i)
        else:
            model.embed_tokens = QuantizedEmbedding(blocks, qtype, int8=i)
    if model.config.tie_word_embeddings and model.lm_head.backend in ("quantized", "int8"):
        model.embed_tokens = QuantizedEmbedding(model.lm_head.packed, model.lm_head.qtype,  # the same blocks
                                                int8=model.lm_head.backend == "int8")
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


def _pack(weights: GGUFWeights, targets: list[Target], int8: list[bool]) -> list[torch.Tensor]:
    packed = []
    for (_, qtype, names), i in zip(targets, int8):
        raw = torch.cat([torch.from_numpy(weights.quantized(name)[1]) for name in names])  # (N, blocks' bytes)
        pack = torch.ops.batchlm.pack_linear_q8 if i else torch.ops.batchlm.pack_linear_q
        packed.append(pack(raw, QUANTIZED_TYPES[qtype]))
    return packed
