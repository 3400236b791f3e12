"""BlockAllocator invariants under random allocate/free."""

import random

import pytest

from batchlm.engine.block_allocator import BlockAllocator, OutOfBlocks


def test_random_alloc_free_keeps_invariants():
    rng = random.Random(0)
    alloc = BlockAllocator(64)
    owners: dict[int, list[int]] = {}  # owner -> blocks
    for step in range(2000):
        if owners and rng.random() < 0.45:
            owner = rng.choice(list(owners))
            alloc.free(owners.pop(owner))
        else:
            n = rng.randint(0, 8)
            if alloc.can_allocate(n):
                owners[step] = alloc.allocate(n)
            else:
                with pytest.raises(OutOfBlocks):
                    alloc.allocate(n)
        held = [b for blocks in owners.values() for b in blocks]
        assert len(held) == len(set(held)), "a block was handed to two owners"
        assert all(0 <= b < 64 for b in held)
        assert alloc.num_used == len(held)
        assert alloc.num_free + alloc.num_used == alloc.num_total == 64


def test_out_of_blocks_takes_nothing():
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    assert alloc.num_free == 1


def test_double_free_raises_and_changes_nothing():
    alloc = BlockAllocator(8)
    blocks = alloc.allocate(3)
    alloc.free(blocks[:1])
    with pytest.raises(ValueError):
        alloc.free(blocks)  # blocks[0] is already free
    assert alloc.num_used == 2
    with pytest.raises(ValueError):
        alloc.free([blocks[1], blocks[1]])
    assert alloc.num_used == 2
    with pytest.raises(ValueError):
        alloc.free([7])  # never allocated
    alloc.free(blocks[1:])
    assert alloc.num_used == 0 and alloc.num_free == 8
