"""Validation of the rows an engine step hands the model runner (clear ValueErrors, no device work).

`view_row` checks one `ScheduledRow` against the runner's limits and returns its `RowView`;
`check_batch` checks what only the whole step can show (shared slots, token and row budgets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replayssm.engine.batch_inputs import RowView


@dataclass(frozen=True)
class RowLimits:
    """What a runner accepts: pool sizes, step budgets, and the decode path in use."""

    num_slots: int
    num_kv_blocks: int
    kv_block_size: int
    q_max: int  # 1 + num_speculative_tokens
    max_num_seqs: int
    max_num_batched_tokens: int
    replayssm: bool
    max_position: int | None = None  # rotary models: positions must stay below it (None: unbounded)


def check_slot(slot: object, name: str, num_slots: int) -> None:
    """`slot` must be an int in [0, num_slots)."""
    if not isinstance(slot, int) or not 0 <= slot < num_slots:
        raise ValueError(f"{name} must be in [0, {num_slots}), got {slot!r}")


def view_row(i: int, r: Any, lim: RowLimits, check_blocks: bool = True) -> RowView:
    """Check row i (a `ScheduledRow`) and return how the runner sees it.

    check_blocks=False skips only the block-id range check, for callers that check every row's
    ids at once (engine/block_tables.py) and rerun this with it when that check fails.
    """
    q = len(r.token_ids)
    if q == 0:
        raise ValueError(f"rows[{i}].token_ids is empty")
    if not isinstance(r.start_pos, int) or r.start_pos < 0:
        raise ValueError(f"rows[{i}].start_pos must be >= 0, got {r.start_pos!r}")
    if not isinstance(r.slot, int) or not 0 <= r.slot < lim.num_slots:  # (no name string per valid row)
        check_slot(r.slot, f"rows[{i}].slot", lim.num_slots)
    if len(r.block_table) * lim.kv_block_size < r.start_pos + q:
        raise ValueError(f"rows[{i}].block_table covers {len(r.block_table) * lim.kv_block_size} "
                         f"tokens, needs {r.start_pos + q}")
    if lim.max_position is not None and r.start_pos + q > lim.max_position:
        raise ValueError(f"rows[{i}] reaches position {r.start_pos + q - 1}, past the rotary table of "
                         f"max_position_embeddings={lim.max_position}")
    # min/max run in C: a Python loop over every id costs ~3 ms per step at 256 rows x 66 blocks.
    if check_blocks and r.block_table and (min(r.block_table) < 0 or max(r.block_table) >= lim.num_kv_blocks):
        raise ValueError(f"rows[{i}].block_table has ids outside [0, {lim.num_kv_blocks})")
    if not 0 <= r.num_logits <= q:
        raise ValueError(f"rows[{i}].num_logits must be in [0, {q}], got {r.num_logits}")
    forced = r.is_prefill and q == 1 and r.start_pos > 0
    decode = not r.is_prefill or forced
    if decode and r.start_pos == 0:
        raise ValueError(f"rows[{i}] is a decode row without prior state (start_pos=0)")
    if decode and q > lim.q_max:
        raise ValueError(f"rows[{i}] has {q} decode tokens, more than 1 + num_speculative_tokens "
                         f"= {lim.q_max}")
    if r.spec_slots is not None:
        if lim.replayssm or not decode or len(r.spec_slots) != q:
            raise ValueError(f"rows[{i}].spec_slots is only for baseline verify rows, one slot per token")
        for s in r.spec_slots:
            check_slot(s, f"rows[{i}].spec_slots entry", lim.num_slots)
    elif decode and q > 1 and not lim.replayssm:
        raise ValueError(f"rows[{i}] verifies {q} tokens without spec_slots (baseline needs them)")
    for b, s in r.checkpoints or ():
        if not isinstance(b, int) or not 1 <= b <= q:
            raise ValueError(f"rows[{i}].checkpoints offset must be in [1, {q}], got {b!r}")
        check_slot(s, f"rows[{i}].checkpoints slot", lim.num_slots)
    # block_table is not copied: it is read only while this step's inputs are built.
    return RowView(i, list(r.token_ids), r.start_pos, r.block_table, r.slot, r.num_logits,
                   None if r.spec_slots is None else list(r.spec_slots), decode, forced,
                   [tuple(c) for c in r.checkpoints] if r.checkpoints else [])


def check_batch(views: list[RowView], lim: RowLimits) -> None:
    """Rows of one step: distinct slots, no overlapping spec or checkpoint slots, within budgets."""
    if not views:
        raise ValueError("rows is empty")
    slots = [v.slot for v in views]
    if len(set(slots)) != len(slots):
        raise ValueError(f"two rows share a slot: {slots}")
    written = [s for v in views for s in (v.spec_slots or []) if s != v.slot]
    if len(set(written)) != len(written) or set(written) & set(slots):
        raise ValueError("spec_slots of different rows overlap each other or another row's slot")
    ckpts = [s for v in views for _, s in v.checkpoints]
    if len(set(ckpts)) != len(ckpts) or set(ckpts) & (set(slots) | set(written)):
        raise ValueError("checkpoint slots must be distinct and differ from every row's slots")
    if sum(len(v.token_ids) for v in views) > lim.max_num_batched_tokens:
        raise ValueError(f"rows hold more than max_num_batched_tokens={lim.max_num_batched_tokens}")
    if sum(v.decode for v in views) > lim.max_num_seqs:
        raise ValueError(f"more than max_num_seqs={lim.max_num_seqs} decode rows")
