"""Rotary position embeddings: cos/sin tables precomputed once, looked up by position each forward."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from batchlm.model.model_config import ModelConfig


class Rope(NamedTuple):
    """cos and signed sin at this step's positions, each (T, 1, hd); shared by every layer."""

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """Tables for every position up to max_position_embeddings, HF "rotate_half" convention
    (the two halves of a head are rotated against each other, not interleaved pairs)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        t = torch.arange(config.max_position_embeddings, dtype=torch.float64)  # (P,)
        freqs = torch.outer(t, rope_inv_freq(config))  # (P, hd/2)
        # NOTE: rotate_half(x) * sin == swap_halves(x) * [-sin, sin]: the sign is folded into the table,
        # so rotating costs one flip and one fused multiply-add per forward.
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], -1).float(), persistent=False)
        self.register_buffer("sin", torch.cat([-freqs.sin(), freqs.sin()], -1).float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """positions (T,) -> Rope with cos, sin (T, 1, hd) in `dtype`."""
        return Rope(self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1))


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate every head of x (T, N, hd) by its token's position; returns a new (T, N, hd) tensor."""
    T, N, hd = x.shape
    swapped = x.reshape(T, N, 2, hd // 2).flip(2).reshape(T, N, hd)  # (T, N, hd): [x2, x1]
    return torch.addcmul(x * rope.cos, swapped, rope.sin)  # x * cos + rotate_half(x) * sin


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (hd/2,) float64, with HF "linear" or "llama3" scaling, or divided by per-frequency
    factors (a GGUF file's llama3 scaling), when configured."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))  # (hd/2,)
    if config.rope_freq_factors is not None:
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    if config.rope_scaling is None:
        return inv_freq
    scaling = dict(config.rope_scaling)
    factor = float(scaling["factor"])
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)
