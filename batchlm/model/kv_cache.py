"""KVCache: preallocated key/value storage for every layer, divided into fixed-size blocks."""

from __future__ import annotations

import numpy as np
import torch

from batchlm.model.model_config import ModelConfig


class KVCache:
    """The K/V tensors only; which block belongs to whom is the BlockAllocator's business.

    Layout: one tensor (num_layers, 2, num_blocks * block_size * num_kv_heads * head_dim), two views of it
    per layer. A slot is block * block_size + offset.
    - V, slot-major: `v[layer]` is (num_slots, KVH, hd); a slot holds one token's V for all KV heads.
    - K, transposed within each block: `k[layer]` is (num_blocks, KVH, hd, block_size), so one block's
      keys for one head are an (hd, block_size) tile and its scores are block_size-wide vector FMAs
      (batchlm/kernels/paged_attention.cpp). attention.py writes and gathers K in this layout.

    Guarantees: storage is allocated once, here, and never resized; `k[layer]` and `v[layer]` are views of
    it, shapes as above. The model is the only writer: it writes exactly the slots named
    in ForwardBatch.slot_mapping. Freed blocks are not zeroed; readers mask everything past a context.
    """

    def __init__(self, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = model_config.num_layers
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # NOTE: zeros, not empty: padded (masked) reads of never-written slots must not see NaN/Inf,
        # since 0 * NaN in the attention-weighted sum would poison the output.
        kvh, hd = self.num_kv_heads, self.head_dim
        shape = (self.num_layers, 2, num_blocks * block_size * kvh * hd)
        self.storage = _lazy_zeros(shape, dtype) if self.device.type == "cpu" else \
            torch.zeros(shape, device=self.device, dtype=dtype)
        self.k = [self.storage[i, 0].view(num_blocks, kvh, hd, block_size)
                  for i in range(self.num_layers)]  # each (num_blocks, KVH, hd, bs)
        self.v = [self.storage[i, 1].view(num_blocks * block_size, kvh, hd)
                  for i in range(self.num_layers)]  # each (num_slots, KVH, hd)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def bytes_per_block(self) -> int:
        """Bytes one block costs across all layers, K and V together (for sizing num_blocks)."""
        return block_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)

    @staticmethod
    def blocks_for_budget(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                          budget_bytes: int) -> int:
        """How many blocks fit in `budget_bytes` (no allocation)."""
        per_block = block_bytes(model_config.num_layers, model_config.num_kv_heads,
                                model_config.head_dim, block_size, dtype)
        return budget_bytes // per_block


def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype) -> int:
    """Bytes of one block: K and V, every layer, `block_size` tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages take memory only once touched: numpy's zeros come from calloc,
    which maps fresh (kernel-zeroed) pages for a large size, where torch.zeros writes every byte. So the
    cache's resident size grows with the tokens it holds, not with the blocks it was given."""
    count = int(np.prod(shape))
    raw = torch.from_numpy(np.zeros(count * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8))
    return raw.view(dtype).view(shape)
