"""Continuous batching with chunked prefill, memory-bounded admission and preemption."""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass, field

from replayssm.cache.block_pool import BlockPool
from replayssm.cache.prefix_cache import PrefixCache
from replayssm.cache.slot_pool import SlotPool
from replayssm.engine.request import Request, RequestStatus
from replayssm.engine.waiting_queue import WaitingQueue


@dataclass
class ScheduledChunk:
    """Tokens ``[start, start + num_tokens)`` of ``request`` run this step."""

    request: Request
    start: int
    num_tokens: int
    num_lookahead: int = 0  # KV room reserved past the chunk for speculative drafts (decode only)
    # Launched ahead (LLMEngine.step): the one input token is the previous step's sample, not
    # appended to the request yet; the runner takes it on the device.
    fed: bool = False

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token, so its logits sample the next one."""
        return self.fed or self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Prefix hits: (checkpoint slot, live slot) copies to run before the forward; the
    # checkpoints stay pinned until `Scheduler.copies_done`.
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Decides which tokens of which requests run in the next step.

    Policy, per step, under a budget of ``max_num_batched_tokens`` tokens:
    1. Running requests, oldest first, each get their uncomputed tokens (1 in decode, a
       chunk in prefill), clipped to the remaining budget. When KV blocks run out, the
       newest running request is preempted by recompute (memory freed, back to the front
       of the waiting queue) until the blocks fit; the oldest request is never preempted
       for a younger one, so it always progresses.
    2. If nothing was preempted for memory, waiting requests are admitted while the budget,
       ``max_num_seqs``, a free slot group and KV blocks for their first chunk allow, in fair
       order between client requests (``WaitingQueue.next_fair``: the parent running the fewest
       first; arrival order within one).
       With a prefix cache, an admitted request (new or resumed) starts after its longest
       cached prefix: it shares those KV blocks and gets the prefix's checkpoint copied into
       its live slot. Cached entries count as free memory (they are evicted LRU on demand).
    Running requests stay sorted by arrival, so "newest" means latest arrival.
    Fair share: before 1., when every seat is taken and a parent holds more than its share of the
    seats (max_num_seqs / parents with work) and at least two more than the waiting parent that
    runs the fewest, its newest running request is preempted (one per step), so a request of many
    choices hands seats to requests that arrive after it within a few steps instead of after all
    its choices finished. The two-seat margin makes the moves converge (no ping-pong).
    Speculative decoding: a decode request also gets up to ``num_lookahead_tokens`` positions
    of budget and KV blocks for its drafts (fewer only near max_model_len or out of budget).
    """

    def __init__(
        self,
        block_pool: BlockPool,
        slot_pool: SlotPool,
        *,
        kv_block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_cache: PrefixCache | None = None,
        num_lookahead_tokens: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.prefix_cache = prefix_cache
        self.block_pool = block_pool
        self.slot_pool = slot_pool
        self.kv_block_size = kv_block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_running_by_parent: dict[Hashable, int] = {}  # running requests per parent_id

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, request: Request, num_tokens: int) -> int:
        total = -(-(request.num_computed_tokens + num_tokens) // self.kv_block_size)
        return max(0, total - len(request.block_table))

    def _lookahead(self, request: Request, n: int, budget: int) -> int:
        """Draft positions for a decode step: never past max_model_len.

        Not capped by max_tokens: a row a few tokens from its end still verifies every draft (the
        tokens past max_tokens are dropped at output), so the step keeps one q for every row and
        replays its CUDA graph; capped, the last steps of a batch ran eagerly with ragged rows.
        """
        if not self.num_lookahead_tokens or n != 1 or request.num_computed_tokens == 0:
            return 0
        room = self.num_lookahead_tokens
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - request.num_tokens)
        return max(0, min(room, budget - 1))

    def _release(self, request: Request) -> None:
        left = self.num_running_by_parent[request.parent_id] - 1
        if left:
            self.num_running_by_parent[request.parent_id] = left
        else:
            del self.num_running_by_parent[request.parent_id]
        self.block_pool.free(request.block_table)
        self.slot_pool.free(request.slots)
        request.block_table = []
        request.slots = []
        request.num_registered_blocks = 0

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self, group: int | None = None) -> SchedulerOutput:
        """Pick this step's chunks; allocates their KV blocks (and slots for new requests).

        group (0 or 1): schedule only the running requests of that group, preempt only among them
        (the other group's step may be in flight), and admit into it while it holds at most half
        of max_num_seqs (rounded up), so the two groups stay balanced (LLMEngine's interleaved
        verify steps). None: every request, one group.
        """
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        mine = self.running if group is None else [r for r in self.running if r.group == group]

        def drop_last() -> Request:
            victim = mine.pop()
            if mine is not self.running:
                self.running.remove(victim)
            return victim

        victim = self.fair_share_victim(mine)
        if victim is not None:
            mine.remove(victim)
            if mine is not self.running:
                self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
        num_fair = len(out.preempted)  # fairness preemptions do not stop admission; memory ones do
        i = 0
        while i < len(mine) and budget > 0:
            request = mine[i]
            n = min(request.num_uncomputed_tokens, budget)
            extra = self._lookahead(request, n, budget)
            need = self._blocks_needed(request, n + extra)
            while not self.block_pool.can_allocate(need) and mine[-1] is not request:
                victim = drop_last()
                self._preempt(victim)
                out.preempted.append(victim)
            if not self.block_pool.can_allocate(need):
                # Only `request` itself is left to give memory back: it waits for recompute.
                assert mine[-1] is request
                self._preempt(drop_last())
                out.preempted.append(request)
                break
            request.block_table.extend(self.block_pool.allocate(need))
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n, extra))
            budget -= n + extra
            i += 1
        seats = -(-self.max_num_seqs // 2)
        while (
            self.waiting
            and len(out.preempted) == num_fair
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and (group is None or len(mine) < seats)
            and self.slot_pool.can_allocate()
        ):
            request = self.waiting.next_fair(self.num_running_by_parent)
            hit = self.prefix_cache.match(request) if self.prefix_cache else None
            if hit:
                self.prefix_cache.acquire(hit)  # nothing of the hit may be evicted below
            start, cached = (hit.num_tokens, hit.blocks) if hit else (0, [])
            n = min(request.num_tokens - start, budget)
            need = -(-(start + n) // self.kv_block_size) - len(cached)
            if not self.block_pool.can_allocate(need) or not self.slot_pool.can_allocate():
                if hit:
                    self.prefix_cache.release(hit)
                break
            self.waiting.remove(request)
            self.num_running_by_parent[request.parent_id] = self.num_running_by_parent.get(request.parent_id,
                                                                                           0) + 1
            request.slots = self.slot_pool.allocate()
            request.block_table = cached + self.block_pool.allocate(need)
            request.num_computed_tokens = start
            if self.prefix_cache:
                self.prefix_cache.count_admission(request, hit)
            if hit:
                out.copies.append((hit.checkpoint, request.slots[0]))
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival)
            if group is not None:
                request.group = group
                mine.append(request)  # only counted from here on (the loop above is done)
            out.chunks.append(ScheduledChunk(request, start, n))
            budget -= n
        return out

    def could_admit(self) -> bool:
        """Whether a waiting request may be admitted by the next `schedule()` (a seat and a slot
        group are free, or a fair-share preemption frees one); False guarantees it would not be."""
        if not self.waiting:
            return False
        seat = len(self.running) < self.max_num_seqs and self.slot_pool.can_allocate()
        return seat or self.fair_share_victim(self.running) is not None

    def fair_share_victim(self, candidates: list[Request]) -> Request | None:
        """The running request (among `candidates`) to preempt so that a waiting parent gets a seat,
        or None: only when no seat is free, and only from the parent running the most, if that is
        more than its share and at least two more than the waiting parent running the fewest."""
        if not self.waiting or (len(self.running) < self.max_num_seqs and self.slot_pool.can_allocate()):
            return None
        counts = self.num_running_by_parent
        if not counts:
            return None
        head = self.waiting.next_fair(counts)
        top = max(counts, key=counts.__getitem__)
        parents = set(counts).union(self.waiting.parents())
        share = -(-self.max_num_seqs // len(parents))
        if counts[top] <= share or counts[top] < counts.get(head.parent_id, 0) + 2:
            return None
        return next((r for r in reversed(candidates) if r.parent_id == top), None)

    def copies_done(self, out: SchedulerOutput) -> None:
        """The runner copied every hit checkpoint of ``out``: unpin them (evictable again)."""
        for src, _ in out.copies:
            self.slot_pool.unpin(src)

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and free its memory (it may be running or waiting)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def check_integrity(self, lent_slots: int = 0) -> None:
        """Assert that pool usage equals what running requests hold (plus `lent_slots` checkpoint
        slots planned for a step still in flight)."""
        self.block_pool.check_integrity()
        self.slot_pool.check_integrity()
        refs = [0] * self.block_pool.num_blocks
        for r in self.running:
            for b in r.block_table:
                refs[b] += 1
        assert refs == self.block_pool.ref_counts, "block references differ from the running tables"
        held_slots = sum(len(r.slots) for r in self.running)
        cached = getattr(self.slot_pool, "num_cached", 0)
        assert held_slots + lent_slots == self.slot_pool.num_slots - self.slot_pool.num_free - cached
        assert all(not r.block_table and not r.slots for r in self.waiting)
        per_parent: dict[Hashable, int] = {}
        for r in self.running:
            per_parent[r.parent_id] = per_parent.get(r.parent_id, 0) + 1
        assert per_parent == self.num_running_by_parent, "running counts per parent are off"
        for r in self.running:
            assert len(r.block_table) * self.kv_block_size >= r.num_computed_tokens
