"""A step's block tables as one padded int32 host tensor, range-checked, without redoing old rows.

Block tables are the largest per-step host input: rows x blocks ids (256 x 65 at 1,000-token
contexts). A Python min/max per row plus `torch.tensor` over the nested lists costs ~1.3 ms per
step there. A request's table only grows between steps (by one block every block_size decode
tokens), so `BlockTables` keeps each slot's last table on the host (a list to compare against,
a tensor row to gather from) and converts and checks only the ids that are new; a table that
is not an extension of the slot's last one (a new request, a preemption) is rewritten whole.
"""

from __future__ import annotations

from array import array

import torch

from replayssm.engine.host_pack import host_tensor


class BlockTables:
    """Per-slot host copy of the last block tables seen (see the module docstring)."""

    def __init__(self, num_slots: int, num_kv_blocks: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        self._lists: list[list[int]] = [[] for _ in range(num_slots)]
        self._rows = torch.full((num_slots, 8), -1, dtype=torch.int32)  # -1 past each table

    def tensor(self, slots: list[int], tables: list[list[int]]) -> torch.Tensor | None:
        """(n, max_blocks) int32 tables of rows with these (valid) slots, -1 past each row's
        blocks, when the slots are distinct and every id is an int in [0, num_kv_blocks); None
        otherwise (nothing is cached then: the caller's per-row and batch checks decide)."""
        if not tables or len(set(slots)) != len(slots):
            return None
        width = max(len(t) for t in tables)
        rows, cols, ids = [], [], []  # new entries: slot row, column, block id
        clear_rows, clear_cols = [], []  # entries past a table that got shorter: back to -1
        changed = []
        lists = self._lists
        for s, t in zip(slots, tables):
            old = lists[s]
            if t == old:  # the common case: nothing new since the last step (a C-level compare)
                continue
            n = len(old)
            start = n if len(t) >= n and (t == old if len(t) == n else t[:n] == old) else 0
            if n > len(t):
                clear_rows.extend([s] * (n - len(t)))
                clear_cols.extend(range(len(t), n))
            if start < len(t):
                rows.extend([s] * (len(t) - start))
                cols.extend(range(start, len(t)))
                ids.extend(t[start:])
            if start < len(t) or n > len(t):
                changed.append((s, t))
        values = None
        if ids:
            try:
                values = torch.frombuffer(array("i", ids), dtype=torch.int32)
            except (TypeError, OverflowError):  # not plain ints: the per-row checks decide
                return None
            if int(values.min()) < 0 or int(values.max()) >= self.num_kv_blocks:
                return None
        if width > self._rows.shape[1]:
            grown = torch.full((self._rows.shape[0], max(width, 2 * self._rows.shape[1])), -1,
                               dtype=torch.int32)
            grown[:, :self._rows.shape[1]] = self._rows
            self._rows = grown
        if clear_rows:
            self._rows[torch.tensor(clear_rows), torch.tensor(clear_cols)] = -1
        if values is not None:
            self._rows[torch.tensor(rows), torch.tensor(cols)] = values
        for s, t in changed:
            self._lists[s] = list(t)
        return self._rows[host_tensor(slots, torch.int64)][:, :width]
