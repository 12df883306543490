"""ReplaySSM forward / commit / materialize vs the float64 per-token oracle."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import pytest
import torch
from conftest import assert_close, bits, poisoned
from ssm_oracle import softplus_dt, ssm_recurrence

from replayssm.ops.replay import (
    replay_commit,
    replay_forward,
    replay_forward_ref,
    replay_materialize,
)
from replayssm.ops.rounding import seed_tensor

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Relative to max(|expected|, 1). bf16 outputs carry 2^-9 rounding; fp16/bf16 states one ulp.
ACT_TOL = {F32: 1e-4, BF16: 1.2e-2}
STATE_TOL = {F32: 1e-4, F16: 2e-3, BF16: 1.6e-2}

# (H, G, P, N, state dtype, act dtype): 1, 8 and 16 heads per group; P 32/64; N 16/64/128.
CASES = [
    (4, 4, 32, 16, F32, F32),
    (8, 1, 32, 64, BF16, BF16),
    (16, 1, 64, 128, F16, F32),
    (16, 2, 32, 128, F32, BF16),
    (2, 2, 64, 64, BF16, F32),
    (16, 1, 32, 16, F16, BF16),
]


@dataclass
class Cache:
    state: torch.Tensor  # (S, H, P, N)
    ring_x: torch.Tensor  # (S, H, R, P)
    ring_B: torch.Tensor  # (S, G, R, N)
    ring_dt: torch.Tensor  # (S, H, R) fp32 Δ
    ring_start: torch.Tensor  # (S,) int32
    committed: torch.Tensor  # (S,) int32

    def clone(self) -> Cache:
        return Cache(*(getattr(self, f.name).clone() for f in fields(self)))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


def make_params(H: int):
    """A < 0, D, dt_bias per head (fp32); Δ lands roughly in [0.05, 1.5]."""
    A = -torch.exp(torch.rand(H) * 2.0 - 1.5)
    D = torch.randn(H)
    dt_bias = torch.rand(H) * 2.0 - 2.0
    return A, D, dt_bias


def make_cache(S, H, G, P, N, R, committed, state_dtype, act_dtype, ring_start=None) -> Cache:
    """Random pool with the given cursors (ring_start random if None); rows outside each history are NaN."""
    if ring_start is None:
        ring_start = torch.randint(0, R, (S,))
    ring_start = torch.as_tensor(ring_start, dtype=torch.int32)
    cache = Cache(
        torch.randn(S, H, P, N).to(state_dtype),
        torch.randn(S, H, R, P).to(act_dtype),
        torch.randn(S, G, R, N).to(act_dtype),
        torch.rand(S, H, R) * 1.2 + 0.05,
        ring_start,
        torch.as_tensor(committed, dtype=torch.int32),
    )
    for s in range(S):
        free = [r for r in range(R) if (r - int(ring_start[s])) % R >= int(cache.committed[s])]
        cache.ring_x[s][:, free] = float("nan")
        cache.ring_B[s][:, free] = float("nan")
        cache.ring_dt[s][:, free] = float("nan")
    return cache


def history(cache: Cache, s: int, n: int | None = None):
    """The first n (default committed) ring entries of slot s: x (n,H,P), B (n,G,N), Δ (n,H)."""
    R = cache.ring_x.shape[2]
    n = int(cache.committed[s]) if n is None else n
    rows = [(int(cache.ring_start[s]) + j) % R for j in range(n)]
    return cache.ring_x[s][:, rows].transpose(0, 1), cache.ring_B[s][:, rows].transpose(0, 1), cache.ring_dt[
        s
    ][:, rows].T


def advance(S0, xs, Bs, deltas, A, D):
    """Oracle state after running the given entries from S0 (C does not affect the state)."""
    return ssm_recurrence(S0, xs, deltas, A, Bs, Bs, D)[1]


def make_step(b, q, H, G, P, N, act_dtype):
    """Random decode inputs: x (b,q,H,P), raw dt (b,q,H) fp32, B, C (b,q,G,N)."""
    x = torch.randn(b, q, H, P).to(act_dtype)
    dt = torch.randn(b, q, H)
    B = torch.randn(b, q, G, N).to(act_dtype)
    C = torch.randn(b, q, G, N).to(act_dtype)
    return x, dt, B, C


def row_slots(S: int, n: int, pad_at: int) -> torch.Tensor:
    """n distinct permuted slots of a pool of S, with a padding row (-1) inserted at pad_at."""
    s = torch.randperm(S)[:n].tolist()
    return torch.tensor(s[:pad_at] + [-1] + s[pad_at:], dtype=torch.int32)


def run_forward(cache: Cache, step, params, idx, W, **kw):
    x, dt, B, C = step
    A, D, dt_bias = params
    out = poisoned(*x.shape, dtype=x.dtype)
    y = replay_forward(x, dt, A, B, C, D, dt_bias, *cache.tensors(), idx, W, out=out, **kw)
    assert y is out
    return y


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("H,G,P,N,state_dtype,act_dtype", CASES)
def test_forward_matches_oracle(H, G, P, N, state_dtype, act_dtype, q):
    """Outputs, flush writes, appends and untouched data match the oracle over checkpoint + history."""
    W, S = 6, 9
    R = W + 3
    params = make_params(H)
    A, D, dt_bias = params
    idx = row_slots(S, 4, pad_at=1)
    slots = [int(s) for s in idx if s >= 0]
    committed = torch.randint(0, W + 1, (S,))
    # Flush (h + q > W), the h + q == W boundary (no flush), an empty ring, a full ring.
    for s, h in zip(slots, [W - q + 1, W - q, 0, W]):
        committed[s] = h
    cache = make_cache(S, H, G, P, N, R, committed, state_dtype, act_dtype)
    before = cache.clone()
    step = make_step(len(idx), q, H, G, P, N, act_dtype)
    y = run_forward(cache, step, params, idx, W)

    x, dt, B, C = step
    assert torch.equal(y[1], torch.zeros_like(y[1])), "padding row output must be zero"
    appended = torch.zeros(S, R, dtype=torch.bool)
    for i, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        h, o = int(before.committed[s]), int(before.ring_start[s])
        S_hist = advance(before.state[s], *history(before, s), A, D)
        y_ref = ssm_recurrence(S_hist, x[i], softplus_dt(dt[i], dt_bias), A, B[i], C[i], D)[0]
        assert_close(y[i], y_ref, ACT_TOL[act_dtype], f"y row {i}")
        if h + q > W:
            assert_close(cache.state[s], S_hist, STATE_TOL[state_dtype], f"flushed state of slot {s}")
        else:
            assert torch.equal(bits(cache.state[s]), bits(before.state[s])), f"slot {s} must not flush"
        rows = [(o + h + t) % R for t in range(q)]
        appended[s, rows] = True
        assert torch.equal(bits(cache.ring_x[s][:, rows]), bits(x[i].transpose(0, 1)))
        assert torch.equal(bits(cache.ring_B[s][:, rows]), bits(B[i].transpose(0, 1)))
        assert_close(cache.ring_dt[s][:, rows], softplus_dt(dt[i], dt_bias).T, 1e-6, "ring_dt")
    untouched = [s for s in range(S) if s not in slots]
    assert torch.equal(bits(cache.state[untouched]), bits(before.state[untouched]))
    for name in ("ring_x", "ring_B", "ring_dt"):
        old, new = bits(getattr(before, name)), bits(getattr(cache, name))
        keep = ~appended[:, None, :, None] if old.dim() == 4 else ~appended[:, None, :]
        assert torch.equal(torch.where(keep, new, 0), torch.where(keep, old, 0)), name
    assert torch.equal(cache.ring_start, before.ring_start) and torch.equal(cache.committed, before.committed)


def test_public_op_equals_ref_on_cpu():
    """On CPU the public op dispatches to the reference: bit-identical outputs and writes."""
    H, G, P, N, W, S = 4, 2, 8, 16, 4, 6
    params = make_params(H)
    cache = make_cache(S, H, G, P, N, W + 2, [4, 1, 3, 0, 2, 4], F16, BF16)
    twin = cache.clone()
    idx = torch.tensor([5, -1, 2, 0], dtype=torch.int32)
    step = make_step(4, 2, H, G, P, N, BF16)
    y = run_forward(cache, step, params, idx, W, rand_seed=seed_tensor(11))
    x, dt, B, C = step
    A, D, dt_bias = params
    y_ref = replay_forward_ref(x, dt, A, B, C, D, dt_bias, *twin.tensors(), idx, W, rand_seed=seed_tensor(11))
    assert torch.equal(bits(y), bits(y_ref))
    for a, b in zip(cache.tensors(), twin.tensors()):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("q", [1, 2])
def test_equal_to_window_does_not_flush(q):
    """committed + q == W keeps the checkpoint bit-exact, the ring grows to W, the next step folds all W."""
    H, G, P, N, W, S = 2, 1, 8, 16, 4, 3
    R = W + 2
    params = make_params(H)
    A, D, dt_bias = params
    cache = make_cache(S, H, G, P, N, R, [0, W - q, 0], F32, F32)
    start = cache.clone()
    idx = torch.tensor([1], dtype=torch.int32)
    step = make_step(1, q, H, G, P, N, F32)
    run_forward(cache, step, params, idx, W)
    assert torch.equal(bits(cache.state), bits(start.state)), "h + q == W must not write the state"
    replay_commit(cache.ring_start, cache.committed, idx, torch.tensor([q], dtype=torch.int32), q, W,
                  ring_rows=R)
    assert int(cache.committed[1]) == W and int(cache.ring_start[1]) == int(start.ring_start[1])
    x, dt, B, C = step
    new = (x[0], B[0], softplus_dt(dt[0], dt_bias))
    entries = [torch.cat([old, cur]) for old, cur in zip(history(start, 1), new)]
    for got, want in zip(history(cache, 1), entries):
        assert_close(got, want, 1e-6, "ring keeps all W entries")
    run_forward(cache, make_step(1, 1, H, G, P, N, F32), params, idx, W)
    assert_close(cache.state[1], advance(start.state[1], *entries, A, D), 1e-4, "fold of all W entries")


@pytest.mark.parametrize("ring_rows", [None, 7])
def test_commit_moves_cursors(ring_rows):
    """Commit uses the accepted count a (not q): flushed -> (o + h, a), else (o, h + a); padding untouched."""
    W, q, S = 4, 3, 8
    ring_start = torch.tensor([6, 2, 5, 0, 4, 3, 1, 6], dtype=torch.int32)
    committed = torch.tensor([0, 1, 2, 4, 3, 0, 4, 2], dtype=torch.int32)
    idx = torch.tensor([3, 0, -1, 6, 1, 4, 7], dtype=torch.int32)
    acc = torch.tensor([1, 2, 3, 3, 1, 2, 1], dtype=torch.int32)
    new_start, new_comm = ring_start.clone(), committed.clone()
    replay_commit(new_start, new_comm, idx, acc, q, W, ring_rows=ring_rows)
    for s in range(S):
        rows = (idx == s).nonzero()
        h, o = int(committed[s]), int(ring_start[s])
        if rows.numel() == 0:
            assert (int(new_start[s]), int(new_comm[s])) == (o, h), f"slot {s} not in the batch"
            continue
        a = int(acc[rows[0, 0]])
        if h + q > W:
            want = ((o + h) % ring_rows if ring_rows else o + h, a)
        else:
            want = (o, h + a)
        assert (int(new_start[s]), int(new_comm[s])) == want, f"slot {s}: h={h} o={o} a={a}"


@pytest.mark.parametrize("state_dtype", [F32, F16, BF16])
def test_materialize_matches_oracle(state_dtype):
    """dst = src checkpoint advanced by n entries (n = 0 copies exactly); src, rings and cursors untouched."""
    H, G, P, N, W, S = 8, 2, 32, 64, 6, 10
    R = W + 2
    A, D, _ = make_params(H)
    cache = make_cache(S, H, G, P, N, R, [6, 3, 0, 5, 2, 6, 1, 0, 4, 6], state_dtype, BF16)
    before = cache.clone()
    src = torch.tensor([0, 3, -1, 5, 1, 8], dtype=torch.int32)
    dst = torch.tensor([7, 2, 9, 4, 6, -1], dtype=torch.int32)
    n = torch.tensor([6, 0, 3, 2, 3, 1], dtype=torch.int32)
    replay_materialize(A, *cache.tensors(), src, n, dst, rand_seed=seed_tensor(5))
    written = []
    for s, d, k in zip(src.tolist(), dst.tolist(), n.tolist()):
        if s < 0 or d < 0:
            continue
        written.append(d)
        if k == 0:
            assert torch.equal(bits(cache.state[d]), bits(before.state[s])), "n = 0 is an exact copy"
        want = advance(before.state[s], *history(before, s, k), A, D)
        assert_close(cache.state[d], want, STATE_TOL[state_dtype], f"materialized {s}->{d} n={k}")
    other = [s for s in range(S) if s not in written]
    assert torch.equal(bits(cache.state[other]), bits(before.state[other]))
    for a, b in zip(cache.tensors()[1:], before.tensors()[1:]):
        assert torch.equal(bits(a), bits(b))


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = v.abs().to(dtype)
    return (bits(d) + 1).view(dtype).float() - d.float()


@pytest.mark.parametrize("state_dtype", [F16, BF16])
def test_flush_write_is_unbiased(state_dtype):
    """Over many seeds the mean flushed fp16/bf16 state equals the fp32 fold (round-to-nearest would not)."""
    H, G, P, N, W, S, seeds = 2, 1, 8, 16, 4, 3, 160
    params = make_params(H)
    cache = make_cache(S, H, G, P, N, W + 1, [0, W, 0], state_dtype, F32)
    idx = torch.tensor([1], dtype=torch.int32)
    step = make_step(1, 1, H, G, P, N, F32)
    exact = cache.clone()
    exact.state = exact.state.float()  # same checkpoint values, fp32 pool: the unrounded fold
    run_forward(exact, step, params, idx, W)
    v = exact.state[1]
    samples = []
    for seed in range(seeds):
        trial = cache.clone()
        run_forward(trial, step, params, idx, W, rand_seed=seed_tensor(seed))
        samples.append(trial.state[1].double())
    ulp = _ulp(v, state_dtype).double()
    err = (torch.stack(samples).mean(0) - v.double()) / ulp  # per element, in ulps
    assert (torch.stack(samples) - v.double()).abs().le(ulp * 1.0001).all(), "a neighbour of the fp32 value"
    assert err.abs().mean() < 0.08, f"mean |bias| {err.abs().mean():.3f} ulp"
    assert err.mean().abs() < 0.02, f"mean bias {err.mean():.3f} ulp"
    rtn = (v.to(state_dtype).double() - v.double()) / ulp
    assert rtn.abs().mean() > 0.15  # the test has power against round-to-nearest


def _forward_args(**over):
    H, G, P, N, W, S, b, q = 4, 2, 8, 16, 4, 5, 2, 2
    A, D, dt_bias = make_params(H)
    cache = make_cache(S, H, G, P, N, W + q, [1, 2, 3, 4, 0], F32, F32)
    x, dt, B, C = make_step(b, q, H, G, P, N, F32)
    args = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, state=cache.state, ring_x=cache.ring_x,
                ring_B=cache.ring_B, ring_dt=cache.ring_dt, ring_start=cache.ring_start,
                committed=cache.committed, state_indices=torch.tensor([3, -1], dtype=torch.int32), window=W)
    args.update(over)
    return args


FORWARD_BAD = [
    ("x", lambda: dict(x=torch.randn(2, 5, 4, 8), dt=torch.randn(2, 5, 4), B=torch.randn(2, 5, 2, 16),
                       C=torch.randn(2, 5, 2, 16))),  # q = 5 > window = 4
    ("ring_x", lambda: dict(window=5)),  # R = 6 < window + q = 7
    ("dt", lambda: dict(dt=torch.randn(2, 2, 3))),
    ("B", lambda: dict(B=torch.randn(2, 2, 2, 16).half())),
    ("C", lambda: dict(C=torch.randn(2, 2, 2, 8))),
    ("x", lambda: dict(x=torch.randn(2, 2, 4, 8).bfloat16())),  # rings are fp32
    ("ring_dt", lambda: dict(ring_dt=torch.rand(5, 4, 6).bfloat16())),
    ("A", lambda: dict(A=-torch.rand(3))),
    ("state_indices", lambda: dict(state_indices=torch.tensor([5, 0], dtype=torch.int32))),
    ("state_indices", lambda: dict(state_indices=torch.tensor([2, 2], dtype=torch.int32))),
    ("state_indices", lambda: dict(state_indices=torch.tensor([1, 0]))),  # int64
    ("committed", lambda: dict(committed=torch.tensor([0, 0, 0, 5, 0], dtype=torch.int32))),
    ("ring_start", lambda: dict(ring_start=torch.tensor([0, 0, 0, -1, 0], dtype=torch.int32))),
    ("out", lambda: dict(out=torch.empty(2, 2, 4, 8, dtype=torch.bfloat16))),
]


@pytest.mark.parametrize("name,over", FORWARD_BAD)
def test_forward_rejects_bad_arguments(name, over):
    """replay_forward raises ValueError naming the bad argument."""
    args = _forward_args(**over())
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}:"):
        replay_forward(**args)


def test_commit_and_materialize_reject_bad_arguments():
    """replay_commit / replay_materialize raise ValueError naming the bad argument."""
    start, comm = torch.zeros(4, dtype=torch.int32), torch.tensor([2, 0, 1, 4], dtype=torch.int32)
    idx, acc = torch.tensor([0, -1], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)
    bad_commit = [
        ("q", dict(q=5)),
        ("num_accepted", dict(num_accepted=torch.tensor([3, 1], dtype=torch.int32))),
        ("num_accepted", dict(num_accepted=torch.tensor([0, 1], dtype=torch.int32))),
        ("state_indices", dict(state_indices=torch.tensor([4, 0], dtype=torch.int32))),
        ("ring_rows", dict(ring_rows=5)),
        ("committed", dict(committed=torch.zeros(4, dtype=torch.int64))),
    ]
    for name, over in bad_commit:
        args = dict(ring_start=start, committed=comm, state_indices=idx, num_accepted=acc, q=2, window=4)
        args.update(over)
        with pytest.raises(ValueError, match=rf"^{name}:"):
            replay_commit(**args)
    A = -torch.rand(4) - 0.1
    cache = make_cache(4, 4, 2, 8, 16, 6, [2, 0, 1, 4], F32, F32)
    bad_mat = [
        ("num_entries", dict(num_entries=torch.tensor([3], dtype=torch.int32))),
        ("dst_indices", dict(dst_indices=torch.tensor([0], dtype=torch.int32))),
        ("src_indices", dict(src_indices=torch.tensor([4], dtype=torch.int32))),
        ("A", dict(A=A.double())),
    ]
    for name, over in bad_mat:
        args = dict(A=A, **dict(zip(["state", "ring_x", "ring_B", "ring_dt", "ring_start", "committed"],
                                    cache.tensors())),
                    src_indices=torch.tensor([0], dtype=torch.int32),
                    num_entries=torch.tensor([1], dtype=torch.int32),
                    dst_indices=torch.tensor([2], dtype=torch.int32))
        args.update(over)
        with pytest.raises(ValueError, match=rf"^{name}:"):
            replay_materialize(**args)
