"""Prefix-hit copies from a checkpoint move state, conv window and cursors, never the (unread) ring rows."""

from __future__ import annotations

import torch
from prefix_helpers import blocks_for, make_runner, one_thread, random_ids, small_checkpoint  # noqa: F401

from replayssm.engine.model_runner import ScheduledRow


def _run(runner, ids, start, table, slot, checkpoints=None):
    row = ScheduledRow(ids, start, table, slot, start == 0 or len(ids) > 1, checkpoints=checkpoints)
    logits = runner.execute([row])
    runner.commit([row], [1])
    return logits


def test_copy_from_checkpoint_skips_ring_and_continues_exactly():
    """A copy from a checkpoint leaves the destination's NaN ring rows as they were, copies state, conv
    and cursors bit-exact, and prefill + decode from the copy match a run that never stopped."""
    path = small_checkpoint()
    ids = random_ids(20, seed=71)
    table = blocks_for(20, 0)
    runner = make_runner(path)
    _run(runner, ids[:8], 0, table, 4, checkpoints=[(8, 6)])
    cache = runner.mamba_cache
    for ring in (*cache.ring_x, *cache.ring_B, *cache.ring_dt):
        ring[6] = 5.0  # a full copy would carry these into slot 9
    runner.copy_slot(6, 9)
    for state, conv in zip(cache.state, cache.conv):
        assert torch.equal(state[9], state[6]) and torch.equal(conv[9], conv[6])
    assert runner.cursors(9) == (0, 0) and int(cache.committed[9]) == 0
    for ring in (*cache.ring_x, *cache.ring_B, *cache.ring_dt):
        assert bool(ring[9].isnan().all())  # as make_runner left it: NaN
    ref = make_runner(path)
    _run(ref, ids[:8], 0, table, 2)
    got, want = [_run(runner, ids[8:16], 8, table, 9)], [_run(ref, ids[8:16], 8, table, 2)]
    for t in range(16, 20):  # decode reads only committed ring rows: NaN rows past them stay unread
        got.append(_run(runner, [ids[t]], t, table, 9))
        want.append(_run(ref, [ids[t]], t, table, 2))
    for g, w in zip(got, want):
        assert bool(torch.isfinite(g).all())
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
