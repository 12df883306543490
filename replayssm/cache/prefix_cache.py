"""Prefix caching, "align" mode: chained block hashes, shared KV blocks, Mamba checkpoints at boundaries.

A prompt prefix of ``t`` tokens is reusable when every KV block covering it is cached (the
blocks are keyed by the hash chain ``h_j = H(h_{j-1}, tokens of block j)``) *and* a Mamba
checkpoint (state + conv window, cursors 0) holds the state after exactly ``t`` tokens, keyed
by ``h_{t/bs - 1}``. Checkpoints exist only at multiples of ``checkpoint_interval`` (itself a
multiple of the KV block size ``bs``).

Publication, per engine step (DESIGN.md §3). ``c0`` = tokens computed before the step, ``q`` =
tokens in the row, ``a`` = accepted (prefill chunk: a = q), boundaries ``t`` with
``c0 < t <= c0 + q`` and ``t % interval == 0``, offset ``b = t - c0`` (1 <= b <= q):

    | phase             | who       | what happens to a boundary t of a row                              |
    |-------------------|-----------|--------------------------------------------------------------------|
    | schedule          | scheduler | hits: pin checkpoint + KV blocks; queue copy ckpt -> live slot     |
    | plan (pre-step)   | here      | skip t if its hash is already published or planned this step;      |
    |                   |           | else lend one slot (free, or evict an LRU checkpoint): (b, slot)   |
    | copies            | runner    | hit copies run; pins dropped                                       |
    | forward           | runner    | prefill rows: the scan returns the exact state at b, the mixer     |
    |                   |           | writes the K-1 conv inputs before b (window included) to the slot  |
    | commit            | runner    | decode rows with b <= a: conv window from window + step inputs[:b] |
    |                   |           | (before the live window moves); after the cursor commit            |
    |                   |           | materialize(live, n = b - a + committed', slot)                    |
    | finish (here)     | engine    | b <= a: publish slot under H(tokens[:t]) (a duplicate is freed);   |
    |                   |           | b > a (rejected drafts): discard. KV blocks that became full and   |
    |                   |           | computed get their hash. All of this before any block is released. |

Why n is never negative (the exact state cannot be folded away before it is published):
after the commit the slot holds S_0 after ``c - committed'`` tokens with ``c = c0 + a``.
Flushed step: the fold took only the h *history* entries, so S_0 is after c0 tokens and
``committed' = a``: n = b >= 1. No flush: S_0 is after ``c0 - h`` tokens, ``committed' = h + a``:
n = h + b. Both lie in [0, committed'], so a boundary is always materializable in the step
that crosses it, and it is published in that step, never later.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from replayssm.cache.prefix_pools import CachingBlockPool, CachingSlotPool
from replayssm.engine.request import Request

ROOT_HASH = b"replayssm-prefix-root"


def hash_block(parent: bytes, tokens: list[int]) -> bytes:
    """Hash of a prefix that ends with ``tokens``, chained on the hash of the prefix before them."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class PrefixHit:
    num_tokens: int  # prefix length served from the cache (a multiple of the checkpoint interval)
    blocks: list[int]  # the KV blocks covering it
    checkpoint: int  # slot with the Mamba state after num_tokens


@dataclass
class PlannedCheckpoint:
    offset: int  # tokens of the row before the boundary (1 <= offset <= row length)
    slot: int


class PrefixCache:
    """Matches, plans and publishes prefix-cache entries over the two caching pools (module docstring)."""

    def __init__(self, block_pool: CachingBlockPool, slot_pool: CachingSlotPool, *, block_size: int,
                 checkpoint_interval: int) -> None:
        # CacheConfig checks the user's prefix_checkpoint_interval.
        assert checkpoint_interval >= block_size, checkpoint_interval
        assert checkpoint_interval % block_size == 0, checkpoint_interval
        self.block_pool, self.slot_pool = block_pool, slot_pool
        self.block_size, self.interval = block_size, checkpoint_interval
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_published = 0

    # ---- hashes ---------------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The first ``num_blocks`` prefix hashes of ``request`` (its known tokens must cover them)."""
        hashes = request.block_hashes
        bs = self.block_size
        assert num_blocks * bs <= request.num_tokens, "hash of tokens not known yet"
        while len(hashes) < num_blocks:
            j = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, request.token_slice(j * bs, (j + 1) * bs)))
        return hashes[:num_blocks]

    # ---- hits -----------------------------------------------------------------------------

    def match(self, request: Request) -> PrefixHit | None:
        """Longest cached prefix of ``request`` that leaves at least one token to compute, or None."""
        if request.wants_prompt_logprobs():
            return None  # cached tokens would skip their prompt logprobs
        best, blocks = None, []
        num_blocks = (request.num_tokens - 1) // self.block_size
        for j, h in enumerate(self.block_hashes(request, num_blocks)):
            block = self.block_pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
            t = (j + 1) * self.block_size
            if t % self.interval == 0:
                slot = self.slot_pool.lookup(h)
                if slot is not None:
                    best = PrefixHit(t, list(blocks), slot)
        return best

    def acquire(self, hit: PrefixHit) -> None:
        """Reference the hit's blocks and pin its checkpoint (nothing of it can be evicted now)."""
        self.block_pool.touch(hit.blocks)
        self.slot_pool.pin(hit.checkpoint)

    def release(self, hit: PrefixHit) -> None:
        """Undo ``acquire`` (admission failed)."""
        self.block_pool.free(hit.blocks)
        self.slot_pool.unpin(hit.checkpoint)

    def count_admission(self, request: Request, hit: PrefixHit | None) -> None:
        """Count queried and hit tokens of an admitted request; the first admission sets num_cached_tokens."""
        n = hit.num_tokens if hit else 0
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += n
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(n, request.num_prompt_tokens)
        request.num_registered_blocks = len(hit.blocks) if hit else 0

    # ---- publication ------------------------------------------------------------------------

    def plan(self, rows: list[tuple[Request, int, int]]) -> list[list[PlannedCheckpoint]]:
        """Checkpoint slots for the boundaries each (request, c0, q) row may cross this step."""
        planned: set[bytes] = set()
        out: list[list[PlannedCheckpoint]] = []
        for request, c0, q in rows:
            mine = []
            first = (c0 // self.interval + 1) * self.interval
            for t in range(first, c0 + q + 1, self.interval):
                if t <= request.num_tokens:  # known tokens: skip what is published or planned already
                    h = self.block_hashes(request, t // self.block_size)[-1]
                    if h in planned or self.slot_pool.lookup(h) is not None:
                        continue
                    planned.add(h)
                slot = self.slot_pool.allocate_checkpoint()
                if slot is None:
                    break
                mine.append(PlannedCheckpoint(t - c0, slot))
            out.append(mine)
        return out

    def discard(self, planned: list[PlannedCheckpoint]) -> None:
        """Give back the checkpoint slots planned for a row whose results are dropped."""
        for p in planned:
            self.slot_pool.discard(p.slot)

    def finish(self, request: Request, c0: int, num_accepted: int, planned: list[PlannedCheckpoint]) -> None:
        """After the step's tokens are appended to ``request`` (and before anything is released):
        publish the checkpoints it reached, discard the rest, hash its newly full KV blocks."""
        for p in planned:
            # A request that stopped inside its accepted drafts knows fewer tokens: skip past them.
            if p.offset <= num_accepted and c0 + p.offset <= request.num_tokens:
                t = c0 + p.offset
                if self.slot_pool.publish(p.slot, self.block_hashes(request, t // self.block_size)[-1]):
                    self.num_published += 1
            else:
                self.slot_pool.discard(p.slot)
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full > request.num_registered_blocks:
            hashes = self.block_hashes(request, full)
            for j in range(request.num_registered_blocks, full):
                self.block_pool.register(request.block_table[j], hashes[j])
            request.num_registered_blocks = full
