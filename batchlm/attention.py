"""Paged attention over the KVCache: per-forward metadata (built once) and the per-layer attention op.

Two groups of sequences, handled differently because they cost differently:
- single-token queries (decode, or a 1-token prefill chunk) attend together in ONE batched SDPA over K/V
  gathered from their blocks, right-padded to the longest context and masked;
- multi-token prefill chunks attend one sequence at a time, each query token to every cached token of its
  sequence at a position <= its own (the chunk sees the earlier chunks already in the cache).
All gather indices and masks depend only on the ForwardBatch: they are built once, reused by every layer.
Contexts are gathered whole blocks at a time (block_size tokens of K or V are contiguous in the cache), so
a gather copies a few large rows rather than one small row per token; the tail of the last block is masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchlm.forward_batch import ForwardBatch


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened T tokens
    end: int  # one past its last row
    blocks: torch.Tensor  # (nb,) int64: the blocks holding positions 0..C-1, C = context_len
    mask: torch.Tensor  # (n, nb * block_size) bool: query i (position C-n+i) may see key j iff j <= C-n+i


@dataclass
class AttentionMetadata:
    """Indices and masks shared by all layers of one forward pass."""

    block_size: int  # tokens per cache block
    slot_mapping: torch.Tensor  # (T,) int64: where each token's K/V is written
    decode_rows: torch.Tensor | None  # (Sd,) rows of T that are single-token queries; None if all T are
    decode_blocks: torch.Tensor | None  # (Sd * nb,) blocks to gather, nb per sequence; None if no decode rows
    decode_mask: torch.Tensor | None  # (Sd, 1, 1, nb * block_size) bool: key j is in that sequence's context
    decode_num_blocks: int  # nb: blocks covering the longest context among the single-token queries
    prefills: list[PrefillChunk]  # multi-token chunks, in batch order

    @property
    def all_decode(self) -> bool:
        """Every token is a single-token query (the common steady-state step): no scatter needed."""
        return self.decode_rows is None and self.decode_blocks is not None

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int, device: torch.device) -> "AttentionMetadata":
        query_lens, context_lens = batch.query_lens, batch.context_lens
        block_tables = batch.block_tables.to(device, non_blocking=True)  # (S, max_blocks)
        starts, start = [], 0
        for n in query_lens:
            starts.append(start)
            start += n
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        meta = cls(block_size=block_size,
                   slot_mapping=batch.slot_mapping.to(device, non_blocking=True),
                   decode_rows=None, decode_blocks=None, decode_mask=None, decode_num_blocks=0, prefills=[])
        if decode:
            meta._build_decode(decode, starts, context_lens, block_tables, block_size, device)
        for i, n in enumerate(query_lens):
            if n > 1:
                meta.prefills.append(_prefill_chunk(
                    starts[i], n, context_lens[i], block_tables[i], block_size, device))
        return meta

    def _build_decode(self, decode: list[int], starts: list[int], context_lens: list[int],
                      block_tables: torch.Tensor, block_size: int, device: torch.device) -> None:
        lens = [context_lens[i] for i in decode]
        nb = -(-max(lens) // block_size)  # blocks covering the longest context
        if len(decode) == len(starts):  # all sequences decode: T == S, row i is sequence i
            tables = block_tables[:, :nb]  # (Sd, nb)
        else:
            self.decode_rows = torch.tensor([starts[i] for i in decode], device=device)  # (Sd,)
            tables = block_tables[torch.tensor(decode, device=device), :nb]  # (Sd, nb)
        self.decode_blocks = tables.reshape(-1)  # (Sd * nb,)
        j = torch.arange(nb * block_size, device=device)  # (nb * bs,)
        lens_t = torch.tensor(lens, device=device)  # (Sd,)
        self.decode_mask = (j[None, :] < lens_t[:, None]).view(len(decode), 1, 1, nb * block_size)
        self.decode_num_blocks = nb


def _prefill_chunk(start: int, n: int, context_len: int, table: torch.Tensor, block_size: int,
                   device: torch.device) -> PrefillChunk:
    nb = -(-context_len // block_size)
    j = torch.arange(nb * block_size, device=device)  # (nb * bs,)
    query_pos = torch.arange(context_len - n, context_len, device=device)  # (n,)
    mask = j[None, :] <= query_pos[:, None]  # (n, nb * bs)
    return PrefillChunk(start=start, end=start + n, blocks=table[:nb], mask=mask)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every query to its sequence's context.

    q: (T, H, hd); k, v: (T, KVH, hd); k_cache, v_cache: (num_slots, KVH, hd). Returns (T, H, hd).
    """
    T, H, hd = q.shape
    KVH = k.shape[1]
    G = H // KVH
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.all_decode:
        return _decode(q, k_cache, v_cache, meta)  # (T, KVH, G, hd) viewed as (T, H, hd)
    out = q.new_empty(T, H, hd)
    if meta.decode_blocks is not None:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], k_cache, v_cache, meta)
    for chunk in meta.prefills:
        qp = q[chunk.start:chunk.end].transpose(0, 1)  # (H, n, hd)
        kp = _gather(k_cache, chunk.blocks, meta.block_size).transpose(0, 1)  # (KVH, nb * bs, hd)
        vp = _gather(v_cache, chunk.blocks, meta.block_size).transpose(0, 1)  # (KVH, nb * bs, hd)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, enable_gqa=G > 1)  # (H, n, hd)
        out[chunk.start:chunk.end] = op.transpose(0, 1)  # (n, H, hd)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
    """Single-token queries, batched. q: (Sd, H, hd) -> (Sd, H, hd)."""
    Sd, H, hd = q.shape
    KVH = k_cache.shape[1]
    L = meta.decode_num_blocks * meta.block_size
    # NOTE: the G query heads that share a KV head become G "query rows" of that KV head, so K/V are
    # never repeated: (Sd, KVH, G, hd) against (Sd, KVH, L, hd), one mask row per sequence.
    qd = q.reshape(Sd, KVH, H // KVH, hd)  # (Sd, KVH, G, hd)
    kd = _gather(k_cache, meta.decode_blocks, meta.block_size).view(Sd, L, KVH, hd)  # (Sd, L, KVH, hd)
    vd = _gather(v_cache, meta.decode_blocks, meta.block_size).view(Sd, L, KVH, hd)  # (Sd, L, KVH, hd)
    kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # (Sd, KVH, L, hd)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)  # (Sd, KVH, G, hd)
    return od.reshape(Sd, H, hd)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Whole blocks of one layer's K or V. cache: (num_slots, KVH, hd); blocks: (n,) -> (n * bs, KVH, hd)."""
    num_slots, KVH, hd = cache.shape
    by_block = cache.view(num_slots // block_size, block_size * KVH * hd)  # (num_blocks, bs * KVH * hd)
    return by_block.index_select(0, blocks).view(-1, KVH, hd)  # (n * bs, KVH, hd)
