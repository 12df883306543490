"""Caching pools and the prefix matcher: three-way split, LRU eviction, pins, duplicates, chained hashes."""

from __future__ import annotations

from replayssm.cache.prefix_cache import PrefixCache, hash_block
from replayssm.cache.prefix_pools import CachingBlockPool, CachingSlotPool
from replayssm.engine.request import Request
from replayssm.sampling_params import SamplingParams


def test_block_pool_caches_hashed_blocks_and_evicts_lru():
    """Freed hashed blocks stay cached, are reused by hits, and are evicted oldest first only when needed."""
    pool = CachingBlockPool(6)
    a = pool.allocate(3)
    for i, b in enumerate(a):
        assert pool.register(b, bytes([i]))
    assert not pool.register(pool.allocate(1)[0], bytes([0]))  # a hash is held once
    pool.free(a)  # tail first: a[2] is the least recently used
    pool.check_integrity()
    assert (pool.num_free, pool.num_used, pool.num_cached) == (2, 1, 3)
    assert pool.can_allocate(5) and not pool.can_allocate(6)
    pool.touch([a[0]])
    assert pool.ref_counts[a[0]] == 1 and pool.num_cached == 2
    got = pool.allocate(3)  # two free, then evicts a[2]
    assert a[2] in got and pool.lookup(bytes([2])) is None and pool.lookup(bytes([1])) == a[1]
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_slot_pool_checkpoints_publish_pin_and_evict():
    """Checkpoint slots: publish (duplicates freed), pinned ones survive eviction, groups evict LRU first."""
    pool = CachingSlotPool(4, slots_per_request=2)
    c1, c2, c3 = (pool.allocate_checkpoint() for _ in range(3))
    assert pool.publish(c1, b"x") and pool.publish(c2, b"y") and not pool.publish(c3, b"x")
    pool.check_integrity()
    assert (pool.num_free, pool.num_cached, pool.num_free_requests) == (2, 2, 2)
    pool.pin(c1)
    group = pool.allocate()  # 2 free slots
    assert pool.can_allocate() is False and pool.allocate_checkpoint() == c2  # evicts the unpinned y
    assert pool.lookup(b"y") is None and pool.lookup(b"x") == c1 and pool.allocate_checkpoint() is None
    pool.unpin(c1)
    pool.check_integrity()
    pool.free(group)
    pool.discard(c2)
    pool.check_integrity()
    assert (pool.num_free, pool.num_cached) == (3, 1)


def test_match_needs_kv_blocks_and_a_checkpoint_and_leaves_a_token():
    """A hit: the last interval boundary with cached KV blocks and a checkpoint, short of the last token."""
    blocks, slots = CachingBlockPool(8), CachingSlotPool(8)
    cache = PrefixCache(blocks, slots, block_size=2, checkpoint_interval=4)
    req = Request("r", list(range(10, 19)), SamplingParams(), seed=0, arrival=0)  # 9 tokens
    hashes = cache.block_hashes(req, 4)
    assert hashes[1] == hash_block(hash_block(b"replayssm-prefix-root", [10, 11]), [12, 13])
    table = blocks.allocate(4)
    for b, h in zip(table, hashes):
        blocks.register(b, h)
    assert cache.match(req) is None  # no checkpoint yet
    for h in (hashes[0], hashes[1], hashes[3]):
        s = slots.allocate_checkpoint()
        slots.publish(s, h)
    hit = cache.match(req)
    assert hit.num_tokens == 8 and hit.blocks == table and hit.checkpoint == slots.lookup(hashes[3])
    short = Request("s", list(range(10, 18)), SamplingParams(), seed=0, arrival=1)  # 8 tokens: 7 usable
    assert cache.match(short).num_tokens == 4
    blocks.free(table[2:3])  # dropping a middle block's hash breaks the chain past it
    blocks.allocate(blocks.num_free)
    blocks.allocate(1)
    assert cache.match(req).num_tokens == 4
