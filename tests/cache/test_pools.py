import random

import pytest

from replayssm.cache.block_pool import BlockPool
from replayssm.cache.slot_pool import SlotPool


def test_block_pool_random_ops_keep_integrity():
    """Random allocate/incref/free sequences keep free + used = total and never hand out a used block."""
    rng = random.Random(0)
    pool = BlockPool(37)
    owners: list[list[int]] = []
    for _ in range(500):
        op = rng.random()
        if op < 0.5:
            n = rng.randint(0, 6)
            if pool.can_allocate(n):
                blocks = pool.allocate(n)
                assert all(pool.ref_counts[b] == 1 for b in blocks)
                assert not any(b in o for o in owners for b in blocks)
                owners.append(blocks)
            else:
                assert n > pool.num_free
        elif op < 0.6 and owners:
            shared = rng.choice(owners)
            pool.incref(shared)
            owners.append(list(shared))
        elif owners:
            pool.free(owners.pop(rng.randrange(len(owners))))
        pool.check_integrity()
        assert pool.num_used == len({b for o in owners for b in o})
    for o in owners:
        pool.free(o)
    pool.check_integrity()
    assert pool.num_free == 37


def test_block_pool_double_free_is_caught():
    """Freeing a block twice trips the pool's invariant."""
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)


@pytest.mark.parametrize("per_request", [1, 3])
def test_slot_pool_groups(per_request):
    """Slots come in groups of slots_per_request, distinct, and all return to the pool."""
    pool = SlotPool(10, per_request)
    groups = []
    while pool.can_allocate():
        g = pool.allocate()
        assert len(g) == per_request
        groups.append(g)
        pool.check_integrity()
    assert len(groups) == 10 // per_request
    assert len({s for g in groups for s in g}) == per_request * len(groups)
    rng = random.Random(1)
    rng.shuffle(groups)
    for g in groups:
        pool.free(g)
        pool.check_integrity()
    assert pool.num_free == 10


def test_slot_pool_rejects_bad_sizes():
    """A pool that cannot hold one request, or a group size below 1, is a ValueError."""
    with pytest.raises(ValueError, match="num_slots"):
        SlotPool(2, 3)
    with pytest.raises(ValueError, match="slots_per_request"):
        SlotPool(2, 0)
