"""Random ReplaySSM step sequences per slot vs the float64 recurrence over exactly the accepted tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from conftest import assert_close, bits
from hypothesis import given, settings
from hypothesis import strategies as st
from ssm_oracle import softplus_dt, ssm_recurrence
from test_replay import (
    ACT_TOL,
    BF16,
    F16,
    F32,
    STATE_TOL,
    advance,
    history,
    make_cache,
    make_params,
    make_step,
    run_forward,
)

from replayssm.ops.replay import replay_commit, replay_materialize
from replayssm.ops.rounding import seed_tensor

LIVE, SCRATCH = 3, 2  # live request slots, then checkpoint slots that materialize writes


@dataclass(frozen=True)
class Step:
    q: int
    order: tuple[int, ...]  # live slots in row order (a permuted subset)
    pad_at: int | None  # where a padding row (-1) is inserted, if any
    accepted: tuple[int, ...]  # a per row, 1 <= a <= q
    publish: tuple[tuple[int, int], ...]  # (live slot, n as a percentage of committed) -> scratch slot


@dataclass(frozen=True)
class Scenario:
    H: int
    G: int
    P: int
    N: int
    W: int
    R: int
    state_dtype: torch.dtype
    act_dtype: torch.dtype
    reduce_start: bool  # pass ring_rows to commit (ring_start kept in [0, R)) or not
    ring_start: tuple[int, ...]
    committed: tuple[int, ...]
    steps: tuple[Step, ...]
    seed: int


@st.composite
def scenarios(draw) -> Scenario:
    H, G = draw(st.sampled_from([(2, 1), (2, 2), (4, 1), (4, 2)]))
    W = draw(st.integers(1, 6))
    q_max = draw(st.integers(1, min(W, 3)))
    R = W + q_max + draw(st.integers(0, 2))
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        q = draw(st.integers(1, q_max))
        order = tuple(draw(st.permutations(range(LIVE)))[: draw(st.integers(1, LIVE))])
        steps.append(Step(
            q=q,
            order=order,
            pad_at=draw(st.none() | st.integers(0, len(order))),
            accepted=tuple(draw(st.integers(1, q)) for _ in order),
            publish=tuple(draw(st.lists(st.tuples(st.integers(0, LIVE - 1), st.integers(0, 100)),
                                        max_size=SCRATCH))),
        ))
    return Scenario(
        H=H, G=G, P=draw(st.sampled_from([4, 8])), N=draw(st.sampled_from([4, 8])), W=W, R=R,
        state_dtype=draw(st.sampled_from([F32, F32, F16, BF16])),
        act_dtype=draw(st.sampled_from([F32, BF16])),
        reduce_start=draw(st.booleans()),
        ring_start=tuple(draw(st.integers(0, R - 1)) for _ in range(LIVE)),
        committed=tuple(draw(st.integers(0, W)) for _ in range(LIVE)),
        steps=tuple(steps),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(deadline=None, max_examples=50)
@given(sc=scenarios())
def test_random_step_sequences_match_recurrence(sc: Scenario):
    """Outputs, flushes, cursors, ring contents and materialized states follow the accepted tokens."""
    torch.manual_seed(sc.seed)
    H, G, P, N, W, R = sc.H, sc.G, sc.P, sc.N, sc.W, sc.R
    # Low-precision checkpoints drift by about one rounding per flush from the float64 chain.
    tol_state = 3 * STATE_TOL[sc.state_dtype]
    tol_y = ACT_TOL[sc.act_dtype] + tol_state
    params = make_params(H)
    A, D, dt_bias = params
    cache = make_cache(LIVE + SCRATCH, H, G, P, N, R, list(sc.committed) + [0] * SCRATCH, sc.state_dtype,
                       sc.act_dtype, ring_start=list(sc.ring_start) + [0] * SCRATCH)
    # Oracle per live slot: float64 checkpoint chain and the history entries since it.
    ckpt = [cache.state[s].double() for s in range(LIVE)]
    hist = [tuple(t.double() for t in history(cache, s)) for s in range(LIVE)]
    start = list(sc.ring_start)

    for k, step in enumerate(sc.steps):
        q = step.q
        rows = list(step.order)
        if step.pad_at is not None:
            rows.insert(step.pad_at, -1)
        idx = torch.tensor(rows, dtype=torch.int32)
        inputs = make_step(len(rows), q, H, G, P, N, sc.act_dtype)
        x, dt, B, C = inputs
        before = cache.clone()
        y = run_forward(cache, inputs, params, idx, W, rand_seed=seed_tensor(k))

        flushed = set()
        for i, s in enumerate(rows):
            if s < 0:
                assert torch.equal(y[i], torch.zeros_like(y[i]))
                continue
            h = hist[s][0].shape[0]
            S_acc = advance(ckpt[s], *hist[s], A, D)
            y_ref = ssm_recurrence(S_acc, x[i], softplus_dt(dt[i], dt_bias), A, B[i], C[i], D)[0]
            assert_close(y[i], y_ref, tol_y, f"step {k} row {i} output")
            if h + q > W:
                flushed.add(s)
                assert_close(cache.state[s], S_acc, tol_state, f"step {k} slot {s} flushed state")
                ckpt[s] = S_acc
        for s in range(LIVE + SCRATCH):
            if s not in flushed:
                assert torch.equal(bits(cache.state[s]), bits(before.state[s])), f"slot {s} wrote w/o flush"

        acc = [1 if s < 0 else step.accepted[step.order.index(s)] for s in rows]
        acc = torch.tensor(acc, dtype=torch.int32)
        ring_rows = R if sc.reduce_start else None
        replay_commit(cache.ring_start, cache.committed, idx, acc, q, W, ring_rows=ring_rows)
        for i, s in enumerate(rows):
            if s < 0:
                continue
            a = int(acc[i])
            new = (x[i, :a].double(), B[i, :a].double(), softplus_dt(dt[i, :a], dt_bias))
            if s in flushed:
                start[s] += hist[s][0].shape[0]
                hist[s] = new
            else:
                hist[s] = tuple(torch.cat([old, cur]) for old, cur in zip(hist[s], new))
        for s in range(LIVE):
            want_start = start[s] % R if sc.reduce_start else start[s]
            assert int(cache.ring_start[s]) == want_start, f"step {k} slot {s} ring_start"
            assert int(cache.committed[s]) == hist[s][0].shape[0], f"step {k} slot {s} committed"
            for got, want in zip(history(cache, s), hist[s]):
                assert_close(got, want, 1e-6, f"step {k} slot {s} ring history")

        if step.publish:
            _check_publish(cache, step.publish, ckpt, hist, A, D, tol_state, k)


def _check_publish(cache, publish, ckpt, hist, A, D, tol_state, k) -> None:
    """Materialize into scratch slots; only those slots change, each to the oracle state at n entries."""
    src = [s for s, _ in publish]
    n = [pct * hist[s][0].shape[0] // 100 for s, pct in publish]
    dst = [LIVE + j for j in range(len(publish))]
    before = cache.clone()
    # A trailing padding row (dst = -1) must be skipped.
    replay_materialize(A, *cache.tensors(), torch.tensor(src + [0], dtype=torch.int32),
                       torch.tensor(n + [0], dtype=torch.int32),
                       torch.tensor(dst + [-1], dtype=torch.int32), rand_seed=seed_tensor(1000 + k))
    for s, m, d in zip(src, n, dst):
        want = advance(ckpt[s], *(t[:m] for t in hist[s]), A, D)
        assert_close(cache.state[d], want, tol_state, f"step {k} materialize {s} n={m}")
    keep = [s for s in range(cache.state.shape[0]) if s not in dst]
    assert torch.equal(bits(cache.state[keep]), bits(before.state[keep]))
    for a, b in zip(cache.tensors()[1:], before.tensors()[1:]):
        assert torch.equal(bits(a), bits(b))
