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
multiplies in integers; with `activations="bfloat16"` the BF16 tensors are packed for batchlm::linear_bf16
(batchlm/kernels/linear.cpp), which rounds each activation to bfloat16 and multiplies with the bfloat16 dot
product. Both are faster, not exact (docs/benchmarking.md gives their agreement with the exact model), and
still batch-invariant. The other types stay on linear_q: F16 among them, whose 10-bit fractions bfloat16's 7
would round.
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

# activations -> the types its kernel multiplies ("float32": all of QUANTIZED_TYPES, batchlm::linear_q)
FAST_TYPES = {"int8": ("Q4_0", "Q4_1", "Q8_0"), "bfloat16": ("BF16",)}


class QuantizedEmbedding(nn.Module):
    """Token id -> its row of a packed (Linear.set_packed) matrix, dequantized: (T,) -> (T, D) float32. The
    same values from every layout (`layout`: Linear.set_packed's)."""

    weight = None  # no dense table: LlamaForCausalLM.weight_plan skips it

    def __init__(self, packed: torch.Tensor, qtype: str, layout: str = "float32") -> None:
        super().__init__()
        self.packed, self.qtype, self.layout = packed, qtype, layout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        if self.layout == "bfloat16":  # (G, K / 2, 64, 2): row i is column i % 64 of group i // 64
            rows = self.packed[ids // 64, :, ids % 64]  # (T, K / 2, 2)
            return rows.reshape(ids.shape[0], 2 * self.packed.shape[1]).float()  # (T, D), exact
        lookup = torch.ops.batchlm.embedding_q8 if self.layout == "int8" else torch.ops.batchlm.embedding_q
        return lookup(self.packed, QUANTIZED_TYPES[self.qtype], ids)  # (T, D)


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

    `activations` "int8" packs the Q4_0, Q4_1 and Q8_0 tensors for batchlm::linear_q8, "bfloat16" the BF16
    linears for batchlm::linear_bf16 (module docstring); where that op has no vector code here it warns and
    keeps float32 activations."""
    targets = _targets(model, weights)
    if not targets:  # nothing the file holds in a kept type (an F32 file, say)
        return 0
    if activations != "float32" and not _fast_is_native(activations):
        log.warning("activations %s: its kernel has no vector code here (%s); using float32", activations,
                    "needs AVX2" if activations == "int8" else "needs AVX-512 BF16")
        activations = "float32"
    layouts = [_layout(module, qtype, activations) for module, qtype, _ in targets]
    packed = SharedPack(weights.path, targets, layouts).load(lambda: _pack(weights, targets, layouts)) if share \
        else None
    if packed is None:
        packed = _pack(weights, targets, layouts)
    for (module, qtype, _), blocks, layout in zip(targets, packed, layouts):
        if isinstance(module, Linear):
            module.set_packed(qtype, blocks, layout)
        else:
            model.embed_tokens = QuantizedEmbedding(blocks, qtype, layout)
    head = model.lm_head
    if model.config.tie_word_embeddings and head.backend in Linear.STORED_BACKENDS:
        model.embed_tokens = QuantizedEmbedding(head.packed, head.qtype, head.layout)  # the same blocks
        return len(targets) + 1
    return len(targets)


def _fast_is_native(activations: str) -> bool:
    return kernels.linear_q8_is_native() if activations == "int8" else kernels.linear_is_native(torch.bfloat16)


def _layout(module: nn.Module, qtype: str, activations: str) -> str:
    """Which kernel's layout a target is packed in (Linear.set_packed): its tier's where that multiplies its
    type, else linear_q's. An untied embedding is only looked up: bfloat16 would not make it faster."""
    if qtype not in FAST_TYPES.get(activations, ()) or (activations == "bfloat16" and not isinstance(module, Linear)):
        return "float32"
    return activations


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


def _pack(weights: GGUFWeights, targets: list[Target], layouts: list[str]) -> list[torch.Tensor]:
    """Each target's blocks in its layout, as bytes (SharedPack stores bytes; set_packed views them)."""
    packed = []
    for (_, qtype, names), layout in zip(targets, layouts):
        raw = torch.cat([torch.from_numpy(weights.quantized(name)[1]) for name in names])  # (N, blocks' bytes)
        if layout == "bfloat16":  # BF16 rows are the values themselves: linear's bfloat16 pairs
            packed.append(torch.ops.batchlm.pack_linear(raw.view(torch.bfloat16)).view(torch.uint8))
            continue
        pack = torch.ops.batchlm.pack_linear_q8 if layout == "int8" else torch.ops.batchlm.pack_linear_q
        packed.append(pack(raw, QUANTIZED_TYPES[qtype]))
    return packed
