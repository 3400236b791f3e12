"""LlamaForCausalLM: a Llama decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) over a paged KV cache.

Every linear layer runs on the flattened (T, D) tokens of all sequences at once; only attention looks at
sequence boundaries (see attention.py). q/k/v and gate/up projections are fused into one matmul each;
`load_hf_state_dict` fuses the Hugging Face tensors as it copies them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from batchlm import kernels
from batchlm.errors import InvalidArgument
from batchlm.model.attention import AttentionMetadata, attend, write_kv
from batchlm.model.backends import ATTENTION_BACKENDS, LINEAR_BACKENDS, POINTWISE_BACKENDS
from batchlm.model.forward_batch import ForwardBatch
from batchlm.model.gguf_file import QUANTIZED_TYPES
from batchlm.model.kv_cache import KVCache
from batchlm.model.model_config import ModelConfig
from batchlm.model.rope import Rope, RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.native = False  # batchlm::rms_norm instead of torch's ops (LlamaForCausalLM.set_pointwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.ops.batchlm.rms_norm(x, self.weight, self.eps)  # (T, D)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # (T, D)

    def add_forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, the norm of x + r), both (T, D): the residual stream and what the next block reads."""
        if self.native:
            return torch.ops.batchlm.add_rms_norm(x, r, self.weight, self.eps)  # (T, D) each
        h = x + r  # (T, D)
        return h, self(h)


class Linear(nn.Module):
    """y = x @ weight.T, no bias; weight is (out_features, in_features) as in HF checkpoints.

    `prepack(backend)` (CPU) trades the dense weight for a packed copy; the dense weight is dropped (no 2x
    memory). Decode streams every weight from DRAM each step (the weights are many times a CPU's L3).
    - "kernel" (float32 or bfloat16, library built with vector code for the dtype): `torch.ops.batchlm.linear`
      (batchlm/kernels/linear.cpp) prefetches the next block of weights while it multiplies the current one,
      and sums every output over k in one fixed order, so a row's bits do not depend on the other rows of
      the call. In a float32 decode step it is cheaper than oneDNN (`batchlm-bench forward` times both).
    - "onednn" (float32 or bfloat16): oneDNN's blocked layout, cheaper than MKL's dense sgemm for the wide
      projections in decode and in prefill. Its result for a row can depend on the other rows of the call:
      in bfloat16 above 32 rows on Intel Xeons, and for down_proj (K = 1408) from 2 rows (float32) or 4
      rows (bfloat16) up on AMD Zen 4. So in bfloat16 the rows go through it at most `ROWS_PER_CALL` at a
      time, which is enough on those Intel CPUs only.
    - "auto": the kernel where it has vector code, else oneDNN, else dense.
    `set_packed` instead holds a GGUF file's Q4_0, Q4_1, Q8_0, F16 or BF16 blocks ("quantized":
    batchlm::linear_q, batchlm/kernels/linear_quant.cpp; batchlm/model/quantized.py packs them),
    bit-identical to "kernel" over the dequantized weight; or Q4_0, Q4_1 or Q8_0 blocks multiplied against
    activations rounded to int8 ("int8": batchlm::linear_q8, linear_int8.cpp); or BF16 weights multiplied
    against activations rounded to bfloat16 ("bfloat16": batchlm::linear_bf16, linear.cpp).
    """

    STORED_BACKENDS = ("quantized", "int8", "bfloat16")  # set_packed's: a GGUF file's weights as stored
    _LAYOUTS = {"float32": "quantized", "int8": "int8", "bfloat16": "bfloat16"}  # set_packed's layout -> backend
    _BACKEND_LAYOUTS = {backend: layout for layout, backend in _LAYOUTS.items()}

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.packed: torch.Tensor | None = None  # the weight in `backend`'s layout once prepacked
        self.backend = "dense"  # what forward multiplies with: "kernel", "onednn", STORED_BACKENDS or "dense"
        self.qtype: str | None = None  # STORED_BACKENDS: the GGUF type of `packed`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "kernel":
            return torch.ops.batchlm.linear(x, self.packed, self.out_features)  # (T, in) -> (T, out)
        if self.backend == "quantized":
            return torch.ops.batchlm.linear_q(x, self.packed, QUANTIZED_TYPES[self.qtype], self.out_features)
        if self.backend == "int8":
            return torch.ops.batchlm.linear_q8(x, self.packed, QUANTIZED_TYPES[self.qtype], self.out_features)
        if self.backend == "bfloat16":
            return torch.ops.batchlm.linear_bf16(x, self.packed, self.out_features)
        if x.dtype is torch.float32 or x.shape[0] <= ROWS_PER_CALL:
            return self._matmul(x)  # (T, in) -> (T, out)
        return torch.cat([self._matmul(rows) for rows in x.split(ROWS_PER_CALL)])  # (T, out)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")  # (T, out)
        return F.linear(x, self.weight)  # (T, in) -> (T, out)

    @property
    def layout(self) -> str | None:
        """STORED_BACKENDS: the layout set_packed took (None otherwise)."""
        return self._BACKEND_LAYOUTS.get(self.backend)

    def prepack(self, backend: str = "auto") -> bool:
        """Switch to a packed weight ("auto", "kernel" or "onednn", see the class); True if it did.

        Returns False, staying dense, where the chosen backend cannot run (device, dtype, build).
        """
        w = self.weight
        if w is None or w.device.type != "cpu":
            return False
        if backend in ("auto", "kernel") and kernels.linear_is_native(w.dtype):
            self.packed, self.backend, self.weight = torch.ops.batchlm.pack_linear(w.detach()), "kernel", None
            return True
        if backend == "kernel" or w.dtype not in PACKED_DTYPES or not _onednn_linear_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_FOR_ROWS)
        except RuntimeError:  # a oneDNN build that cannot pack this shape: stay dense
            return False
        self.packed, self.backend, self.weight = packed, "onednn", None
        return True

    def set_packed(self, qtype: str, packed: torch.Tensor, layout: str = "float32") -> None:
        """Hold `packed`, this weight's blocks of type `qtype` in `layout`: "float32" pack_linear_q's, "int8"
        pack_linear_q8's, "bfloat16" (a BF16 weight) pack_linear's as bytes; the dense weight is dropped."""
        groups = -(-self.out_features // 64)
        if layout == "bfloat16":
            packed = packed.view(torch.bfloat16)  # (G, K / 2, 64, 4) bytes -> (G, K / 2, 64, 2)
        if packed.dim() != (4 if layout == "bfloat16" else 3) or packed.shape[0] != groups:
            raise ValueError(f"packed {qtype} blocks {tuple(packed.shape)} do not fit {self.out_features} rows")
        self.packed, self.qtype, self.weight = packed, qtype, None
        self.backend = self._LAYOUTS[layout]


_PACK_FOR_ROWS = 8  # oneDNN picks its blocked layout for this many input rows (a decode batch)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
ROWS_PER_CALL = 32  # reduced precision: the most rows one matmul call gets (see Linear)


def _onednn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class RowsKept:
    """The rows of T a layer keeps (`ForwardBatch.logits_indices`) and their attention metadata."""

    rows: torch.Tensor  # (R,) int64 indices into T
    meta: AttentionMetadata  # single-token queries at those rows (AttentionMetadata.for_last_tokens)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.H, self.KVH, self.hd = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = Linear(config.hidden_size, (self.H + 2 * self.KVH) * self.hd, dtype)
        self.o_proj = Linear(self.H * self.hd, config.hidden_size, dtype)
        self.native = False  # batchlm::rope_write_kv instead of apply_rope and write_kv (set_pointwise)

    def forward(self, x: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, keep: RowsKept | None = None) -> torch.Tensor:
        """(T, D) -> (T, D); with `keep`, K/V of all T tokens are cached but only the kept rows attend
        and come out: (len(keep.rows), D)."""
        T = x.shape[0]
        H, KVH = self.H, self.KVH
        qkv = self.qkv_proj(x).view(T, H + 2 * KVH, self.hd)  # (T, H + 2KVH, hd)
        if self.native:  # one pass: rotate q and k, store k and v in their slots
            q = torch.ops.batchlm.rope_write_kv(qkv, rope.cos, rope.sin, k_cache, v_cache,
                                                meta.slot_mapping)  # (T, H, hd)
        else:
            qk = apply_rope(qkv[:, :H + KVH], rope)  # (T, H + KVH, hd): q and k rotated together
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KVH:]  # (T, H, hd), (T, KVH, hd), (T, KVH, hd)
            write_kv(k, v, k_cache, v_cache, meta)
        if keep is not None:
            q, meta = q[keep.rows], keep.meta  # (S, H, hd)
        out = attend(q, k_cache, v_cache, meta)  # (T or S, H, hd)
        return self.o_proj(out.reshape(q.shape[0], H * self.hd))  # (T or S, D)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype)
        self.native = False  # batchlm::silu_mul instead of torch's ops (LlamaForCausalLM.set_pointwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2I)
        if self.native:
            return self.down_proj(torch.ops.batchlm.silu_mul(gate_up))  # (T, D)
        gate, up = gate_up.chunk(2, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)  # (T, D)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, h: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, keep: RowsKept | None = None) -> torch.Tensor:
        """(T, D) -> (T, D), or (S, D) for the kept rows only (see Attention.forward)."""
        attn = self.self_attn(self.input_layernorm(h), rope, k_cache, v_cache, meta, keep)  # (T or S, D)
        h, normed = self.post_attention_layernorm.add_forward(h if keep is None else h[keep.rows], attn)
        return h + self.mlp(normed)  # (T or S, D)


class LlamaForCausalLM(nn.Module):
    """Parameters are allocated but NOT initialized: fill them with `load_hf_state_dict` (see load_model).

    NOTE: with tie_word_embeddings, lm_head gets its own copy of the embedding matrix (inference only,
    nothing is trained), so lm_head can be packed for speed while the embedding stays a lookup table.
    """

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        # NOTE: allocated where and as they will live, and never initialized: the checkpoint fills them. Not
        # on the meta device and then moved with to_empty: the embedding's random init there imports
        # torch._dynamo, and to_empty's empty_like of a meta tensor imports sympy, seconds of every load.
        with torch.device(device):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,  # a weight given: no init
                                             _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
            self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)
        self.rotary = RotaryEmbedding(config).to(device)  # float32 tables, real values
        self.attention_kernel = False  # set_attention: the native kernel instead of SDPA
        self.eval()

    def _use_kernels(self, field: str, backend: str, choices: tuple[str, ...], who_needs: str) -> bool:
        """Check a choice of `field` ("kernel", "torch" or "auto"); True if the native ops will run.

        They can run on a CPU model in float32 or bfloat16 once the library is built; "kernel" where they
        cannot raises InvalidArgument(field), "auto" then falls back to torch.
        """
        if backend not in choices:
            raise InvalidArgument(field, f"must be one of {choices}, got {backend!r}")
        usable = self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) and kernels.load()
        if backend == "kernel" and not usable:
            raise InvalidArgument(field, f"{who_needs} a CPU model in float32 or bfloat16 and a built library "
                                  "(python -m batchlm.kernels)")
        return usable and backend != "torch"

    def set_attention(self, backend: str) -> str:
        """Choose the attention path; returns the one in use ("kernel" or "torch").

        "kernel": torch.ops.batchlm.paged_attention (CPU, float32/bfloat16, built by batchlm.kernels);
        raises InvalidArgument("attention") if it cannot run here. "torch": SDPA over gathered K/V.
        "auto": the kernel wherever it can run, else torch.
        """
        self.attention_kernel = self._use_kernels("attention", backend, ATTENTION_BACKENDS,
                                                  "the batchlm attention kernel needs")
        return "kernel" if self.attention_kernel else "torch"

    def set_pointwise(self, backend: str) -> str:
        """Choose the element-wise path of every layer; returns the one in use ("kernel" or "torch").

        "kernel": batchlm::rms_norm, add_rms_norm, silu_mul and rope_write_kv (batchlm/kernels/pointwise.cpp;
        CPU, float32/bfloat16, built by batchlm.kernels); raises InvalidArgument("pointwise") if they cannot
        run here. "torch": torch's ops. "auto": the kernels wherever they can run.
        """
        native = self._use_kernels("pointwise", backend, POINTWISE_BACKENDS, "the batchlm element-wise kernels need")
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.native = native
        return "kernel" if native else "torch"

    @property
    def pointwise_backend(self) -> str:
        """What the element-wise ops run on: "kernel" or "torch" (set_pointwise)."""
        return "kernel" if self.norm.native else "torch"

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Write the K/V of all T tokens into their slots, attend, return logits (S, V) float32.

        Only the rows at `batch.logits_indices` reach lm_head: (R, V), R >= S.
        """
        device = self.device
        meta = AttentionMetadata.build(batch, kv_cache.block_size, device, use_kernel=self.attention_kernel)
        input_ids = batch.input_ids.to(device, non_blocking=True)  # (T,)
        positions = batch.positions.to(device, non_blocking=True)  # (T,)
        rope = self.rotary(positions, self.dtype)  # cos, sin: (T, 1, hd) each
        h = self.embed_tokens(input_ids)  # (T, D)
        rows = batch.logits_indices.to(device, non_blocking=True)  # (R,)
        # NOTE: only the last layer's outputs at `rows` reach lm_head, so when a prompt chunk feeds more
        # tokens than there are rows, that layer caches every token's K/V but attends, projects and
        # runs its MLP for those rows alone (a prompt token skips about a tenth of its linear FLOPs).
        keep = None
        if batch.num_tokens > rows.shape[0]:
            keep = RowsKept(rows, AttentionMetadata.for_last_tokens(
                batch, kv_cache.block_size, device, use_kernel=self.attention_kernel))
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, kv_cache.k[i], kv_cache.v[i], meta, keep if i == last else None)  # (T, D)
        if keep is None:
            h = h[rows]  # (R, D)
        return self.lm_head(self.norm(h)).float()  # (R, V)

    def prepack_linears(self, backend: str = "auto") -> int:
        """CPU: move every Linear to a packed weight (Linear.prepack; "auto", "kernel" or "onednn").

        Returns how many moved. Call after loading; packed weights are no longer loadable. "kernel" raises
        InvalidArgument("linear") where batchlm::linear has no vector code for the model (not on CPU, not
        built, or no AVX-512 or AVX2 for float32, no AVX-512 BF16 for bfloat16: kernels.linear_is_native).
        """
        if backend not in LINEAR_BACKENDS:
            raise InvalidArgument("linear", f"must be one of {LINEAR_BACKENDS}, got {backend!r}")
        if backend == "kernel" and not (self.device.type == "cpu" and kernels.linear_is_native(self.dtype)):
            raise InvalidArgument("linear", "the batchlm linear kernel needs a CPU model, a built library "
                                  "(python -m batchlm.kernels) and AVX-512 or AVX2 (AVX-512 BF16 for bfloat16)")
        return sum(m.prepack(backend) for m in self.modules() if isinstance(m, Linear) and m.weight is not None)

    @property
    def linear_backend(self) -> str:
        """What lm_head (and so every Linear, packed alike) multiplies with: "kernel", "onednn", one of
        Linear.STORED_BACKENDS or "dense"."""
        return self.lm_head.backend

    def weight_plan(self) -> list[tuple[nn.Module, tuple[str, ...]]]:
        """(module whose `weight` it fills, the HF tensor names concatenated along dim 0 to fill it), for
        every weight of the model; the fused projections take several."""
        plan: list[tuple[nn.Module, tuple[str, ...]]] = [
            (self.embed_tokens, ("model.embed_tokens.weight",)), (self.norm, ("model.norm.weight",))]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            plan += [
                (layer.input_layernorm, (p + "input_layernorm.weight",)),
                (layer.post_attention_layernorm, (p + "post_attention_layernorm.weight",)),
                (layer.self_attn.qkv_proj, tuple(f"{p}self_attn.{x}_proj.weight" for x in "qkv")),
                (layer.self_attn.o_proj, (p + "self_attn.o_proj.weight",)),
                (layer.mlp.gate_up_proj, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                (layer.mlp.down_proj, (p + "mlp.down_proj.weight",)),
            ]
        lm_head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return plan + [(self.lm_head, (lm_head,))]

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a HF Llama state dict (names as in model.safetensors) into the fused parameters.

        Raises KeyError naming the first missing tensor, ValueError on a shape mismatch or unused tensors.
        """
        plan = [(module.weight, names) for module, names in self.weight_plan()]
        with torch.no_grad():
            for target, names in plan:
                if target is None:  # held quantized (batchlm/model/quantized.py), loaded already
                    continue
                offset = 0
                for name in names:  # NOTE: copied piece by piece, so no fused temporary is ever allocated
                    value = tensors[name]
                    rows = value.shape[0]
                    if offset + rows > target.shape[0] or value.shape[1:] != target.shape[1:]:
                        raise ValueError(f"{name}: shape {tuple(value.shape)} does not fit "
                                         f"{tuple(target.shape)}")
                    target[offset:offset + rows].copy_(value)
                    offset += rows
                if offset != target.shape[0]:
                    raise ValueError(f"{names[-1]}: filled {offset} of {target.shape[0]} rows")
        used = {name for _, names in plan for name in names}
        unused = [n for n in tensors.keys() if n not in used and not n.endswith("rotary_emb.inv_freq")]
        if self.config.tie_word_embeddings:
            unused = [n for n in unused if n != "lm_head.weight"]
        if unused:
            more = " ..." if len(unused) > 5 else ""
            raise ValueError(f"unexpected tensors in checkpoint: {unused[:5]}{more}")
