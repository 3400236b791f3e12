"""BlockAllocator: hands out KV block ids and keeps full blocks findable by their tokens (prefix caching).
It owns no tensors; KVCache holds the storage.

A full block may be *cached* under a key (the token ids from the start of its sequence to its end, so
equal keys mean equal K/V). A cached block can be held by several sequences at once (a reference count);
when the last one lets it go it stays cached, *evictable*, and is taken back, least recently released
first, only when a block is needed and none is free. So `num_free` counts evictable blocks: nothing waits
or is preempted because cached blocks hold space.

Invariants (checked by tests/unit/test_block_allocator.py):
- a block id is free, evictable or held, never two of these; a block that is not cached has one holder;
- `num_free + num_used == num_total` at all times;
- freeing a block that is not held raises, and a failed call changes nothing;
- `allocate(n)` and `free(blocks)` cost O(n).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence


class OutOfBlocks(RuntimeError):
    """`allocate(n)` was asked for more blocks than are free. Callers check `num_free` first."""


class BlockAllocator:
    """A free list over block ids `0 .. num_blocks-1`, with a cache of full blocks by key."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_total = num_blocks
        # NOTE: FIFO reuse spreads writes over the cache; it also makes a stale block id easier
        # to catch in tests than LIFO would.
        self._free: deque[int] = deque(range(num_blocks))
        self._holders: dict[int, int] = {}                 # held block -> how many sequences hold it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld; least recently released first
        self._block_of: dict[Hashable, int] = {}            # key -> cached block
        self._key_of: dict[int, Hashable] = {}              # cached block -> key
        self.num_evictions = 0

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return len(self._holders)

    @property
    def num_cached(self) -> int:
        """Blocks findable by key, held or not."""
        return len(self._key_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, free ones first, then the least recently released cached ones (they stop
        being cached); raises OutOfBlocks (and takes none) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self.num_evictions += 1
            self._holders[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Let go of held blocks (a sequence's, last block first, so that its tail is evicted before its
        head); raises ValueError (and frees none) on a block that is not held or appears twice."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block listed twice in free({blocks})")
        stray = [b for b in blocks if b not in self._holders]
        if stray:
            raise ValueError(f"freeing blocks that are not allocated: {stray}")
        for block in blocks:
            self._holders[block] -= 1
            if self._holders[block]:
                continue
            del self._holders[block]
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # --- prefix caching ---
    def cached_prefix(self, keys: Sequence[Hashable]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first one (not taken: see `take`)."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` are evictable: taking them lowers `num_free` by that much."""
        return sum(1 for b in blocks if b in self._evictable)

    def take(self, blocks: Iterable[int]) -> None:
        """Hold cached blocks found by `cached_prefix` once more each."""
        for block in blocks:
            if block in self._evictable:
                del self._evictable[block]
                self._holders[block] = 1
            else:
                self._holders[block] += 1

    def cache(self, block: int, key: Hashable) -> bool:
        """Make a held, full block findable by `key`; False (and nothing changes) if another block
        already holds that key or this block is cached already."""
        if block not in self._holders:
            raise ValueError(f"caching block {block}, which is not allocated")
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True
