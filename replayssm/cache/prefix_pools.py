"""Pools that keep unreferenced prefix-cache entries around until memory is needed.

Both pools split their ids three ways, and ``check_integrity`` asserts the split:

    | state  | KV block (CachingBlockPool)          | Mamba slot (CachingSlotPool)                 |
    |--------|--------------------------------------|----------------------------------------------|
    | free   | ref 0, no hash                       | in no request, no checkpoint                 |
    | used   | ref > 0 (hashed or not)              | a request's slot, a checkpoint being written |
    |        |                                      | this step, or a checkpoint pinned by a hit   |
    | cached | ref 0, hashed: evictable, LRU order  | a published checkpoint, ref 0: evictable,    |
    |        |                                      | LRU order                                    |

    free + used + cached = total (each pool)

Allocation takes free ids first and evicts the least recently used cached entry only when
none is free, so ``can_allocate`` counts free + cached. Eviction drops the entry's hash; a
hashed KV block that is still referenced is never evicted (it is not cached, it is used).
"""

from __future__ import annotations

from collections import OrderedDict

from replayssm.cache.block_pool import BlockPool
from replayssm.cache.slot_pool import SlotPool


class CachingBlockPool(BlockPool):
    """KV blocks; a full block holding known tokens may carry its prefix hash (see the module table)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref-0 hashed blocks, LRU first
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free) + len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref 1 each): free ones first, then evict the least recently used cached."""
        assert self.can_allocate(n), f"asked for {n} blocks, {len(self._free) + len(self._cached)} available"
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                del self.block_of[self.hash_of.pop(b)]
                self.num_evictions += 1
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference each (tail first); at ref 0 a hashed block is cached, others are free."""
        for b in reversed(blocks):
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self.hash_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def touch(self, blocks: list[int]) -> None:
        """Take one reference to each hashed block of a prefix hit (cached ones become used)."""
        for b in blocks:
            assert b in self.hash_of, f"touch of unhashed block {b}"
            if self.ref_counts[b] == 0:
                del self._cached[b]
            self.ref_counts[b] += 1

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the prefix ``block_hash`` ends with, if cached or used."""
        return self.block_of.get(block_hash)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Give a used, full block its prefix hash; False (no change) if the hash is already held."""
        assert self.ref_counts[block] > 0, f"register of unused block {block}"
        if block_hash in self.block_of or block in self.hash_of:
            return False
        self.block_of[block_hash] = block
        self.hash_of[block] = block_hash
        return True

    def check_integrity(self) -> None:
        """free + used + cached = total; ref counts >= 0; hashes consistent with the cached set."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert all(r >= 0 for r in self.ref_counts), "negative ref count"
        used = {b for b, r in enumerate(self.ref_counts) if r > 0}
        assert not (free & used) and not (free & cached) and not (cached & used), "block in two states"
        assert len(free) + len(used) + len(cached) == self.num_blocks, "free + used + cached != total"
        assert all(b in self.hash_of for b in cached), "cached block without a hash"
        assert not any(b in self.hash_of for b in free), "free block with a hash"
        assert {self.block_of[h]: h for h in self.block_of} == self.hash_of, "hash maps disagree"


class CachingSlotPool(SlotPool):
    """Mamba slots; besides request groups it lends single slots to prefix checkpoints.

    Checkpoint life: ``allocate_checkpoint`` (used) -> the runner writes it this step ->
    ``publish`` (cached, keyed by the hash of the prefix it ends; a duplicate is freed) or
    ``discard`` (free: the boundary was not reached). A hit ``pin``s a checkpoint (used) until
    its copy into the request's live slot ran, then ``unpin`` returns it to the cache.
    """

    def __init__(self, num_slots: int, slots_per_request: int = 1) -> None:
        super().__init__(num_slots, slots_per_request)
        self.hash_of: dict[int, bytes] = {}
        self.slot_of: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # published, unpinned: LRU first
        self._pins: dict[int, int] = {}
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_free_requests(self) -> int:
        return (len(self._free) + len(self._cached)) // self.slots_per_request

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._cached:
            s, _ = self._cached.popitem(last=False)
            del self.slot_of[self.hash_of.pop(s)]
            self.num_evictions += 1
            return s
        return None

    def can_allocate(self) -> bool:
        return len(self._free) + len(self._cached) >= self.slots_per_request

    def allocate(self) -> list[int]:
        """Take one request's slots (free ones first, then evicted checkpoints); element 0 is live."""
        assert self.can_allocate(), "no free slot group"
        slots = [self._take() for _ in range(self.slots_per_request)]
        self._used.update(slots)
        return slots

    def allocate_checkpoint(self) -> int | None:
        """One slot for a checkpoint to be written this step, or None when every slot is in use."""
        s = self._take()
        if s is not None:
            self._used.add(s)
        return s

    def publish(self, slot: int, block_hash: bytes) -> bool:
        """Cache a written checkpoint under ``block_hash``; a hash already held frees the slot (False)."""
        assert slot in self._used and slot not in self.hash_of, f"publish of slot {slot}"
        if block_hash in self.slot_of:
            self.free([slot])
            return False
        self._used.remove(slot)
        self.hash_of[slot], self.slot_of[block_hash] = block_hash, slot
        self._cached[slot] = None
        return True

    def discard(self, slot: int) -> None:
        """Return an unwritten checkpoint slot."""
        self.free([slot])

    def lookup(self, block_hash: bytes) -> int | None:
        """The checkpoint slot holding the state after the prefix ``block_hash`` ends, if any."""
        return self.slot_of.get(block_hash)

    def pin(self, slot: int) -> None:
        """Keep a checkpoint from eviction until ``unpin`` (a hit copies it this step)."""
        assert slot in self.hash_of, f"pin of slot {slot} without a checkpoint"
        if self._pins.get(slot, 0) == 0:
            del self._cached[slot]
            self._used.add(slot)
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            del self._pins[slot]
            self._used.remove(slot)
            self._cached[slot] = None

    def check_integrity(self) -> None:
        """free + used + cached = total; pins >= 1 only on used checkpoints; hashes consistent."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "duplicate slot in the free list"
        used = self._used
        assert not (free & used) and not (free & cached) and not (cached & used), "slot in two states"
        assert len(free) + len(self._used) + len(cached) == self.num_slots, "free + used + cached != total"
        assert all(s in self.hash_of for s in cached), "cached slot without a checkpoint"
        assert not any(s in self.hash_of for s in free), "free slot with a checkpoint"
        assert all(n >= 1 and s in self._used and s in self.hash_of for s, n in self._pins.items()), "bad pin"
        assert {self.slot_of[h]: h for h in self.slot_of} == self.hash_of, "hash maps disagree"
