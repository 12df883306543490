"""Runner lifecycle: reordering moves no data, slot moves carry everything, one-token final chunks publish."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "prefix"))
from prefix_helpers import (  # noqa: E402, F401 (autouse fixture)
    assert_checkpoint,
    blocks_for,
    fresh_prefill_state,
    make_runner,
    one_thread,
    random_ids,
    small_checkpoint,
)

from replayssm.engine.model_runner import ScheduledRow  # noqa: E402


def snapshot(runner) -> list[torch.Tensor]:
    return [t.clone() for t in runner.mamba_cache.per_slot_tensors()]


def assert_untouched(runner, before: list[torch.Tensor], written: set[int]) -> None:
    """Every slot outside `written` is bit-exact as before (NaN rows included)."""
    keep = [s for s in range(runner.num_slots) if s not in written]
    for old, new in zip(before, runner.mamba_cache.per_slot_tensors()):
        torch.testing.assert_close(new[keep], old[keep], rtol=0, atol=0, equal_nan=True)


def test_reordered_rows_give_the_same_logits_and_touch_only_their_slots():
    """Permuting the rows of each step changes no logits, and no step writes a slot outside its rows."""
    path = small_checkpoint()
    ids = [random_ids(18, seed=50 + i) for i in range(3)]
    slots, tables = [11, 2, 7], [blocks_for(18, 5 * i) for i in range(3)]
    results = []
    for order in ([0, 1, 2], [2, 0, 1]):
        runner = make_runner(path)
        t = [5, 3, 6]
        got = {i: [] for i in range(3)}
        for step in range(8):
            perm = order if step % 2 else order[::-1]
            rows = [ScheduledRow(ids[i][:t[i]], 0, tables[i], slots[i], True) if step == 0
                    else ScheduledRow([ids[i][t[i]]], t[i], tables[i], slots[i], False) for i in perm]
            before = snapshot(runner)
            logits = runner.execute(rows)
            runner.commit(rows, [1] * 3)
            assert_untouched(runner, before, set(slots))
            for i, row_logits in zip(perm, logits):
                got[i].append(row_logits)
            t = [x + (step > 0) for x in t]  # prefill covered [0, t); decode steps add one each
        results.append(got)
    for i in range(3):
        torch.testing.assert_close(torch.stack(results[0][i]), torch.stack(results[1][i]), rtol=1e-5,
                                   atol=1e-5)


def test_slot_move_mid_ring_then_publish_and_one_token_final_chunk():
    """A slot moved mid-ring keeps decoding and publishes exact checkpoints; a one-token final prefill
    chunk on prior state runs as decode and publishes its boundary too."""
    path = small_checkpoint()
    ids = random_ids(16, seed=60)
    runner = make_runner(path)
    table = blocks_for(16, 0)
    for start, stop in ((0, 5), (5, 6)):  # the second chunk is a one-token final chunk: a decode row
        row = ScheduledRow(ids[start:stop], start, table, 4, True, checkpoints=[(1, 6)] if start else None)
        runner.execute([row])
        runner.commit([row], [1])
    assert runner.cursors(4) == (0, 1)
    assert_checkpoint(runner, 6, fresh_prefill_state(path, ids[:6]))
    live = 4
    for t in range(6, 14):
        if t == 8:  # committed = 3 entries pending: move everything to another slot
            before = snapshot(runner)
            runner.copy_slot(4, 13)
            assert_untouched(runner, before, {13})
            assert runner.cursors(13) == runner.cursors(4) and runner.cursors(13)[1] > 0
            live = 13
        row = ScheduledRow([ids[t]], t, table, live, False, checkpoints=[(1, 9)])
        before = snapshot(runner)
        runner.execute([row])
        runner.commit([row], [1])
        assert_untouched(runner, before, {live, 9})
        assert_checkpoint(runner, 9, fresh_prefill_state(path, ids[:t + 1]))
