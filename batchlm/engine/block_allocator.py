"""BlockAllocator: hands out KV block ids. It owns no tensors; KVCache holds the storage.

Invariants (checked by tests/unit/test_block_allocator.py):
- a block id is either free or allocated, never both, and is handed to at most one owner at a time;
- `num_free + num_used == num_total` at all times;
- freeing a block that is not allocated raises, and a failed call changes nothing;
- `allocate(n)` and `free(blocks)` cost O(n).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable


class OutOfBlocks(RuntimeError):
    """`allocate(n)` was asked for more blocks than are free. Callers check `num_free` first."""


class BlockAllocator:
    """A free list over block ids `0 .. num_blocks-1`."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_total = num_blocks
        # NOTE: FIFO reuse spreads writes over the cache; it also makes a stale block id easier
        # to catch in tests than LIFO would.
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks; raises OutOfBlocks (and takes none) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the free list; raises ValueError (and frees none) on a block that is
        not allocated or appears twice."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block listed twice in free({blocks})")
        stray = [b for b in blocks if b not in self._used]
        if stray:
            raise ValueError(f"freeing blocks that are not allocated: {stray}")
        self._used.difference_update(blocks)
        self._free.extend(blocks)
