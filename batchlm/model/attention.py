"""Paged attention over the KVCache: per-forward metadata (built once) and the per-layer attention op.

On CPU, when the native kernel is built (batchlm.kernels), every query token attends in one call of
`torch.ops.batchlm.paged_attention`, which reads K/V in place from the cache blocks and computes each
token exactly as it would alone (no padding, no grouping: see paged_attention.cpp). That makes greedy
decoding independent of the batch even in bfloat16, and it skips the gathers the torch path needs.

The torch path (other devices, or no kernel) uses SDPA. Two groups of sequences, handled differently
because they cost differently:
- single-token queries (decode, or a 1-token prefill chunk) attend in batched SDPAs over K/V gathered
  from their blocks, right-padded and masked. Padding to the longest context of the whole batch wastes
  most of the gather when lengths differ widely (64 sequences at 20..700 tokens), so the queries are
  split into at most `MAX_DECODE_GROUPS` groups of similar length, each padded to its own longest;
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

from batchlm.model.forward_batch import ForwardBatch


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened T tokens
    end: int  # one past its last row
    blocks: torch.Tensor  # (nb,) int64: the blocks holding positions 0..C-1, C = context_len
    mask: torch.Tensor  # (n, nb * block_size) bool: query i (position C-n+i) may see key j iff j <= C-n+i


# NOTE: a group costs about 5 more op calls per layer, about what gathering and attending over 64
# padding blocks costs; a new group starts only where it saves at least that much.
MAX_DECODE_GROUPS = 4
SPLIT_SAVING_BLOCKS = 64


@dataclass
class DecodeGroup:
    """Single-token queries of similar context length, attended in one SDPA."""

    rows: torch.Tensor | None  # (n,) rows of T in this group; None if the group is all of T, in order
    blocks: torch.Tensor  # (n * nb,) blocks to gather, nb per sequence
    mask: torch.Tensor  # (n, 1, 1, nb * block_size) bool: key j is in that sequence's context
    num_blocks: int  # nb: blocks covering the longest context in the group


@dataclass
class KernelIndex:
    """What the native kernel needs: each token's sequence and how many keys it sees."""

    block_tables: torch.Tensor  # (S, max_blocks) int64, contiguous
    seq_ids: torch.Tensor  # (T,) int64: the block-table row of each token
    key_lens: torch.Tensor  # (T,) int64: position + 1, the keys (positions 0..) each token attends to


@dataclass
class AttentionMetadata:
    """Indices and masks shared by all layers of one forward pass."""

    block_size: int  # tokens per cache block
    slot_mapping: torch.Tensor  # (T,) int64: where each token's V is written (slot = block * bs + offset)
    decode_groups: list[DecodeGroup]  # torch path: the single-token queries, by length; empty if none
    prefills: list[PrefillChunk]  # torch path: multi-token chunks, in batch order
    kernel: KernelIndex | None = None  # set when the native kernel attends (then the two above are empty)

    def __post_init__(self) -> None:
        # where each token's K goes in the block-transposed K cache: (block, offset), shared by all layers
        self.key_block = self.slot_mapping.div(self.block_size, rounding_mode="floor")  # (T,)
        self.key_offset = self.slot_mapping.remainder(self.block_size)  # (T,)

    @property
    def all_decode(self) -> bool:
        """Every token is a single-token query of one group (a steady-state step): no scatter needed."""
        return len(self.decode_groups) == 1 and self.decode_groups[0].rows is None

    @classmethod
    def for_last_tokens(cls, batch: ForwardBatch, block_size: int, device: torch.device,
                        use_kernel: bool = False) -> "AttentionMetadata":
        """Metadata for attending only the rows at `batch.logits_indices` (each sequence's last scheduled
        token, and the prompt positions whose log-probabilities are asked for), as single-token queries
        over the context up to each; K/V are written with the full batch's metadata. The model's last
        layer uses it: nothing reads its other rows."""
        rows = batch.logits_indices
        if rows.shape[0] == batch.num_seqs:  # one row per sequence: its last token
            context_lens, tables = batch.context_lens, batch.block_tables
        else:
            ends = torch.tensor(batch.query_lens, device=rows.device).cumsum(0)
            owner = torch.searchsorted(ends, rows, right=True)   # (R,) the sequence of each row
            context_lens, tables = (batch.positions[rows] + 1).tolist(), batch.block_tables[owner]
        last = ForwardBatch(
            input_ids=batch.input_ids[rows], positions=batch.positions[rows],
            slot_mapping=batch.slot_mapping[rows], query_lens=[1] * rows.shape[0],
            context_lens=context_lens, block_tables=tables, logits_indices=torch.arange(rows.shape[0]))
        return cls.build(last, block_size, device, use_kernel)

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int, device: torch.device,
              use_kernel: bool = False) -> "AttentionMetadata":
        """`use_kernel`: index for torch.ops.batchlm.paged_attention (CPU) instead of SDPA groups."""
        query_lens, context_lens = batch.query_lens, batch.context_lens
        slot_mapping = batch.slot_mapping.to(device, non_blocking=True)
        if use_kernel:
            seq_ids, key_lens = [], []
            for i, (n, c) in enumerate(zip(query_lens, context_lens)):
                seq_ids += [i] * n
                key_lens += range(c - n + 1, c + 1)
            index = KernelIndex(block_tables=batch.block_tables.to(device).contiguous(),
                                seq_ids=torch.tensor(seq_ids, device=device),
                                key_lens=torch.tensor(key_lens, device=device))
            return cls(block_size=block_size, slot_mapping=slot_mapping, decode_groups=[], prefills=[],
                       kernel=index)
        block_tables = batch.block_tables.to(device, non_blocking=True)  # (S, max_blocks)
        starts, start = [], 0
        for n in query_lens:
            starts.append(start)
            start += n
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        meta = cls(block_size=block_size, slot_mapping=slot_mapping, decode_groups=[], prefills=[])
        if decode:
            groups = group_by_length([context_lens[i] for i in decode], block_size)
            if len(groups) == 1 and len(decode) == len(starts):  # T == S, row i is sequence i
                meta.decode_groups.append(_decode_group(
                    decode, starts, context_lens, block_tables, block_size, device, in_order=True))
            else:
                for members in groups:
                    meta.decode_groups.append(_decode_group(
                        [decode[m] for m in members], starts, context_lens, block_tables, block_size,
                        device, in_order=False))
        for i, n in enumerate(query_lens):
            if n > 1:
                meta.prefills.append(_prefill_chunk(
                    starts[i], n, context_lens[i], block_tables[i], block_size, device))
        return meta


def group_by_length(lens: list[int], block_size: int) -> list[list[int]]:
    """Split queries (indices into `lens`) into groups of similar context length, longest first.

    Sorted by blocks needed, a new group starts where padding every later query only to this one's
    length (instead of the group's longest) saves at least SPLIT_SAVING_BLOCKS blocks, at most
    MAX_DECODE_GROUPS groups. Indices within a group keep no particular order.
    """
    blocks = [-(-n // block_size) for n in lens]
    order = sorted(range(len(lens)), key=lambda i: -blocks[i])
    groups = [[order[0]]]
    longest = blocks[order[0]]
    for pos in range(1, len(order)):
        i = order[pos]
        saving = (longest - blocks[i]) * (len(order) - pos)  # padding blocks a cut here saves
        if len(groups) < MAX_DECODE_GROUPS and saving >= SPLIT_SAVING_BLOCKS:
            groups.append([i])
            longest = blocks[i]
        else:
            groups[-1].append(i)
    return groups


def _decode_group(seqs: list[int], starts: list[int], context_lens: list[int], block_tables: torch.Tensor,
                  block_size: int, device: torch.device, in_order: bool) -> DecodeGroup:
    """The group of sequences `seqs`; `in_order` when they are all of the batch, in batch order."""
    lens = [context_lens[i] for i in seqs]
    nb = -(-max(lens) // block_size)  # blocks covering the longest context of the group
    if in_order:
        rows, tables = None, block_tables[:, :nb]  # (Sd, nb)
    else:
        rows = torch.tensor([starts[i] for i in seqs], device=device)  # (n,)
        tables = block_tables[torch.tensor(seqs, device=device), :nb]  # (n, nb)
    j = torch.arange(nb * block_size, device=device)  # (nb * bs,)
    lens_t = torch.tensor(lens, device=device)  # (n,)
    mask = (j[None, :] < lens_t[:, None]).view(len(seqs), 1, 1, nb * block_size)
    return DecodeGroup(rows=rows, blocks=tables.reshape(-1), mask=mask, num_blocks=nb)


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

    q: (T, H, hd); k, v: (T, KVH, hd); k_cache: (num_blocks, KVH, hd, bs), keys transposed within a block;
    v_cache: (num_slots, KVH, hd) (see KVCache). Returns (T, H, hd).
    """
    write_kv(k, v, k_cache, v_cache, meta)
    return attend(q, k_cache, v_cache, meta)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store this step's keys and values (T, KVH, hd) in the slots `meta.slot_mapping` names."""
    by_offset = k_cache.permute(0, 3, 1, 2)  # (num_blocks, bs, KVH, hd): a view, writes go through
    by_offset[meta.key_block, meta.key_offset] = k
    v_cache.index_copy_(0, meta.slot_mapping, v)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attend each query (T, H, hd) to its sequence's keys and values, already in the cache; (T, H, hd)."""
    T, H, hd = q.shape
    G = H // k_cache.shape[1]
    bs = meta.block_size
    if meta.kernel is not None:
        index = meta.kernel
        return torch.ops.batchlm.paged_attention(q.contiguous(), k_cache, v_cache, index.block_tables,
                                                 index.seq_ids, index.key_lens, bs, hd ** -0.5)
    if meta.all_decode:
        return _decode(q, k_cache, v_cache, meta.decode_groups[0], meta.block_size)  # (T, H, hd)
    out = q.new_empty(T, H, hd)
    for group in meta.decode_groups:
        out[group.rows] = _decode(q[group.rows], k_cache, v_cache, group, meta.block_size)
    for chunk in meta.prefills:
        qp = q[chunk.start:chunk.end].transpose(0, 1)  # (H, n, hd)
        kp = _gather_keys(k_cache, chunk.blocks).transpose(0, 1)  # (KVH, nb * bs, hd)
        vp = _gather(v_cache, chunk.blocks, meta.block_size).transpose(0, 1)  # (KVH, nb * bs, hd)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, enable_gqa=G > 1)  # (H, n, hd)
        out[chunk.start:chunk.end] = op.transpose(0, 1)  # (n, H, hd)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
            block_size: int) -> torch.Tensor:
    """One group of single-token queries, batched. q: (Sd, H, hd) -> (Sd, H, hd)."""
    Sd, H, hd = q.shape
    KVH = k_cache.shape[1]
    L = group.num_blocks * block_size
    # NOTE: the G query heads that share a KV head become G "query rows" of that KV head, so K/V are
    # never repeated: (Sd, KVH, G, hd) against (Sd, KVH, L, hd), one mask row per sequence.
    qd = q.reshape(Sd, KVH, H // KVH, hd)  # (Sd, KVH, G, hd)
    kd = _gather_keys(k_cache, group.blocks).view(Sd, L, KVH, hd)  # (Sd, L, KVH, hd)
    vd = _gather(v_cache, group.blocks, block_size).view(Sd, L, KVH, hd)  # (Sd, L, KVH, hd)
    kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # (Sd, KVH, L, hd)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask)  # (Sd, KVH, G, hd)
    return od.reshape(Sd, H, hd)


def _gather_keys(k_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks of one layer's K, back in slot order. k_cache: (num_blocks, KVH, hd, bs) -> (n * bs, KVH, hd)."""
    _, KVH, hd, _ = k_cache.shape
    return k_cache.index_select(0, blocks).permute(0, 3, 1, 2).reshape(-1, KVH, hd)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Whole blocks of one layer's V. cache: (num_slots, KVH, hd); blocks: (n,) -> (n * bs, KVH, hd)."""
    num_slots, KVH, hd = cache.shape
    by_block = cache.view(num_slots // block_size, block_size * KVH * hd)  # (num_blocks, bs * KVH * hd)
    return by_block.index_select(0, blocks).view(-1, KVH, hd)  # (n * bs, KVH, hd)
