"""Published checkpoints (state + conv window) equal a fresh prefill of the same prefix."""

from __future__ import annotations

import pytest
from prefix_helpers import (  # noqa: F401 (autouse fixture)
    assert_checkpoint,
    blocks_for,
    fresh_prefill_state,
    make_runner,
    one_thread,
    random_ids,
    small_checkpoint,
)

from replayssm.engine.model_runner import ScheduledRow


@pytest.mark.parametrize("replayssm", [True, False])
def test_prefill_chunk_publishes_inner_boundaries(replayssm):
    """A prefill chunk publishes exact checkpoints at boundaries inside it (not only at chunk ends)."""
    path = small_checkpoint()
    ids = random_ids(19, seed=1)
    runner = make_runner(path, replayssm=replayssm)
    table = blocks_for(19, 3)
    first = ScheduledRow(ids[:6], 0, table, 2, True, num_logits=0, checkpoints=[(1, 9), (4, 5)])
    runner.execute([first])
    runner.commit([first], [1])
    second = ScheduledRow(ids[6:19], 6, table, 2, True, checkpoints=[(2, 7), (10, 11), (13, 4)])
    runner.execute([second])
    runner.commit([second], [1])
    for slot, t in ((9, 1), (5, 4), (7, 8), (11, 16), (4, 19)):
        assert_checkpoint(runner, slot, fresh_prefill_state(path, ids[:t], replayssm=replayssm))


@pytest.mark.parametrize("replayssm", [True, False])
def test_decode_publishes_every_step_through_flushes(replayssm):
    """Token-by-token decode (W=4) publishes the exact state at every step: mid-ring and on flush steps."""
    path = small_checkpoint()
    ids = random_ids(16, seed=2)
    runner = make_runner(path, replayssm=replayssm)
    table = blocks_for(16, 0)
    row = ScheduledRow(ids[:5], 0, table, 3, True)
    runner.execute([row])
    runner.commit([row], [1])
    flushes = 0
    for t in range(5, 15):
        h = runner.cursors(3)[1]
        flushes += replayssm and h + 1 > 4
        row = ScheduledRow([ids[t]], t, table, 3, False, checkpoints=[(1, 8 + t % 2)])
        runner.execute([row])
        runner.commit([row], [1])
        assert_checkpoint(runner, 8 + t % 2, fresh_prefill_state(path, ids[:t + 1], replayssm=replayssm))
    assert flushes >= 2 or not replayssm


@pytest.mark.parametrize("replayssm", [True, False])
def test_verify_window_partial_acceptance(replayssm):
    """Verify rows publish the boundaries inside the accepted prefix (exact) and nothing past it."""
    path = small_checkpoint()
    ids = random_ids(24, seed=3)
    runner = make_runner(path, replayssm=replayssm, num_speculative_tokens=3)
    table = blocks_for(24, 0)
    row = ScheduledRow(ids[:6], 0, table, 0, True)
    runner.execute([row])
    runner.commit([row], [1])
    t, live, spare = 6, 0, [1, 2, 3]
    # (accepted, wrong draft index): partial acceptance with flushes (W=4, q=4 flushes whenever h > 0)
    for step, (a, wrong) in enumerate([(2, 2), (4, None), (1, 1), (3, 3), (2, 2)]):
        toks = list(ids[t:t + 4])
        if wrong is not None:
            toks[wrong] = (toks[wrong] + 1) % 256
        slots = [live] + spare
        dsts = [8 + step % 2 * 4 + j for j in range(4)]
        row = ScheduledRow(toks, t, table, live, False, num_logits=4,
                           spec_slots=None if replayssm else slots, checkpoints=list(zip(range(1, 5), dsts)))
        runner.execute([row])
        new_live = runner.commit([row], [a])[0]
        for b in range(1, a + 1):
            ref = fresh_prefill_state(path, ids[:t + b], replayssm=replayssm)
            assert_checkpoint(runner, dsts[b - 1], ref)
        live, spare, t = new_live, [s for s in slots if s != new_live], t + a


def test_several_requests_cross_boundaries_in_one_step():
    """Prefill, decode and verify rows of three requests publish in one step; each checkpoint is exact."""
    path = small_checkpoint()
    a_ids, b_ids, c_ids = random_ids(20, 4), random_ids(20, 5), random_ids(20, 6)
    runner = make_runner(path, num_speculative_tokens=2)
    ta, tb, tc = blocks_for(20, 0), blocks_for(20, 5), blocks_for(20, 10)
    rows = [ScheduledRow(a_ids[:7], 0, ta, 5, True), ScheduledRow(b_ids[:3], 0, tb, 1, True)]
    runner.execute(rows)
    runner.commit(rows, [1, 1])
    for _ in range(3):  # fill b's ring
        rows = [ScheduledRow([b_ids[3 + _]], 3 + _, tb, 1, False)]
        runner.execute(rows)
        runner.commit(rows, [1])
    rows = [ScheduledRow(c_ids[:9], 0, tc, 14, True, checkpoints=[(4, 2), (8, 3)]),
            ScheduledRow(a_ids[7:10], 7, ta, 5, False, num_logits=3, checkpoints=[(1, 0), (2, 8)]),
            ScheduledRow([b_ids[6]], 6, tb, 1, False, checkpoints=[(1, 12)])]
    runner.execute(rows)
    runner.commit(rows, [1, 3, 1])
    for slot, ids, t in ((2, c_ids, 4), (3, c_ids, 8), (0, a_ids, 8), (8, a_ids, 9), (12, b_ids, 7)):
        assert_checkpoint(runner, slot, fresh_prefill_state(path, ids[:t]))
