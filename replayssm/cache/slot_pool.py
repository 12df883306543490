"""Pool of Mamba slot ids (one slot = state + conv window + ring + cursors)."""

from __future__ import annotations


class SlotPool:
    """Hands out Mamba slots ``0 .. num_slots-1`` in groups of ``slots_per_request``.

    With ReplaySSM a request needs one slot (its live checkpoint + ring). The baseline with
    k draft tokens needs 1 + k: the live slot plus one destination per draft position for the
    per-draft states of a verify step. A group's first slot is the live one. The model runner
    resets a slot's cursors when a prefill writes it, so a reused slot needs no cleanup here.
    """

    def __init__(self, num_slots: int, slots_per_request: int = 1) -> None:
        if slots_per_request < 1:
            raise ValueError(f"slots_per_request must be >= 1, got {slots_per_request}")
        if num_slots < slots_per_request:
            raise ValueError(f"num_slots ({num_slots}) cannot hold one request ({slots_per_request} slots)")
        self.num_slots = num_slots
        self.slots_per_request = slots_per_request
        # Stack: the most recently freed slots are reused first (warm in cache).
        self._free: list[int] = list(reversed(range(num_slots)))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_free_requests(self) -> int:
        """How many more requests can get their slots."""
        return len(self._free) // self.slots_per_request

    def can_allocate(self) -> bool:
        return len(self._free) >= self.slots_per_request

    def allocate(self) -> list[int]:
        """Take one request's slots; element 0 is the live slot."""
        assert self.can_allocate(), "no free slot group"
        slots = [self._free.pop() for _ in range(self.slots_per_request)]
        self._used.update(slots)
        return slots

    def free(self, slots: list[int]) -> None:
        """Return a request's slots."""
        for s in reversed(slots):
            assert s in self._used, f"free of unused slot {s}"
            self._used.remove(s)
            self._free.append(s)

    def check_integrity(self) -> None:
        """Assert free + used = total with no slot in both or twice."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate slot in the free list"
        assert free.isdisjoint(self._used), "a slot is both free and used"
        assert free | self._used == set(range(self.num_slots)), "free + used != total"
