"""Pool of paged-attention KV block ids with reference counts."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out KV block ids ``0 .. num_blocks-1``; the tensors live in the model runner.

    A block is *used* while its reference count is > 0 and *free* otherwise. Today every used
    block has exactly one owner (a running request); ``incref`` exists so prefix caching can
    share blocks later. Mutators: ``allocate`` (ref 0 -> 1), ``incref`` (+1), ``free`` (-1,
    back to the free list at 0). Freed blocks go to the back of the free list, so the
    most recently freed blocks are reused last.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (each with ref count 1)."""
        assert self.can_allocate(n), f"asked for {n} blocks, {len(self._free)} free"
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Add one reference to each (already used) block."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 return to the free list.
        Pass a request's table in order: blocks are released tail first."""
        for b in reversed(blocks):
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        """Assert free + used = total and that the free list holds exactly the ref-0 blocks."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate block in the free list"
        used = {b for b, r in enumerate(self.ref_counts) if r > 0}
        assert all(r >= 0 for r in self.ref_counts), "negative ref count"
        assert free.isdisjoint(used), "a block is both free and used"
        assert len(free) + len(used) == self.num_blocks, "free + used != total"
