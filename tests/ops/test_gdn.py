"""Gated DeltaNet op ladder vs the float64 per-token recurrence (itself checked against transformers)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import pytest
import torch
from conftest import assert_close, bits, poisoned

from replayssm.ops.common import heads_from_groups
from replayssm.ops.gdn import (
    _length_groups,
    gdn_chunked_ref,
    gdn_chunked_varlen_ref,
    gdn_recurrence_ref,
    gdn_replay_forward,
    gdn_replay_materialize,
    gdn_state_update,
)
from replayssm.ops.replay import replay_commit
from replayssm.ops.rounding import round_states, seed_tensor

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
# Relative to max(|expected|, 1): bf16 outputs carry 2^-9 rounding, a bf16 state one ulp.
ACT_TOL = {F32: 1e-4, BF16: 1.2e-2}
STATE_TOL = {F32: 1e-4, BF16: 1.6e-2}
# (Hk, Hv, Dk, Dv): 1, 4 and 3 value heads per key head; Dk != Dv in two.
HEADS = [(2, 2, 16, 16), (1, 4, 32, 16), (2, 6, 16, 8)]


def make_tokens(b, n, Hk, Hv, Dk, Dv, dtype=F32):
    """Random raw q, k (b, n, Hk, Dk), v (b, n, Hv, Dv) in dtype; fp32 g in [-0.8, -0.02], beta in
    [0.05, 0.95]."""
    q, k = torch.randn(b, n, Hk, Dk).to(dtype), torch.randn(b, n, Hk, Dk).to(dtype)
    v = torch.randn(b, n, Hv, Dv).to(dtype)
    return q, k, v, -(torch.rand(b, n, Hv) * 0.78 + 0.02), torch.rand(b, n, Hv) * 0.9 + 0.05


def run64(S0, q, k, v, g, beta):
    """Float64 recurrence over one sequence (no batch dim): (o (n, Hv, Dv), states (n, Hv, Dk, Dv))."""
    o, states = gdn_recurrence_ref(q[None], k[None], v[None], g[None], beta[None], S0[None], dtype=F64)
    return o[0], states[0]


def advance(S0, k, v, g, beta):
    """Float64 state after running the given entries from S0 (q does not affect the state)."""
    if k.shape[0] == 0:
        return S0.double()
    return run64(S0, k, k, v, g, beta)[1][-1]


def unit_keys(k, Hv):
    """Raw k (n, Hk, Dk) -> float64 L2-normalized (n, Hv, Dk)."""
    k = k.double()
    return heads_from_groups(k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6), Hv)


def deltas64(S0, k, v, g, beta):
    """Float64 e_t = beta_t (v_t - a_t S_{t-1}^T k_t) of each token run from S0: (n, Hv, Dv)."""
    S, out = S0.double(), []
    for kn, vt, gt, bt in zip(unit_keys(k, v.shape[1]), v.double(), g.double(), beta.double()):
        S = torch.exp(gt)[:, None, None] * S
        e = bt[:, None] * (vt - torch.einsum("hkv,hk->hv", S, kn))
        S = S + kn[:, :, None] * e[:, None, :]
        out.append(e)
    return torch.stack(out) if out else torch.zeros(0, *S0.shape[:1], S0.shape[-1], dtype=F64)


def values64(S0, k, e, g):
    """The float64 v whose run from S0 with beta = 1 adds the deltas e (inverts `deltas64`):
    v_t = e_t + a_t S_{t-1}^T k_t."""
    S, out = S0.double(), []
    for kn, et, gt in zip(unit_keys(k, e.shape[1]), e.double(), g.double()):
        S = torch.exp(gt)[:, None, None] * S
        out.append(et + torch.einsum("hkv,hk->hv", S, kn))
        S = S + kn[:, :, None] * et[:, None, :]
    return torch.stack(out) if out else e.double()


@dataclass
class Cache:
    state: torch.Tensor  # (S, Hv, Dk, Dv)
    ring_k: torch.Tensor  # (S, Hk, R, Dk)
    ring_e: torch.Tensor  # (S, Hv, R, Dv) fp32
    ring_g: torch.Tensor  # (S, Hv, R) fp32
    ring_start: torch.Tensor  # (S,) int32
    committed: torch.Tensor  # (S,) int32

    def clone(self) -> Cache:
        return Cache(*(getattr(self, f.name).clone() for f in fields(self)))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


def make_cache(S, Hk, Hv, Dk, Dv, R, committed, state_dtype, act_dtype) -> Cache:
    """Random pool, random ring_start, random deltas e (beta times a normal: any e is the delta of some v,
    `values64`; the ring keeps no beta); rows outside each history are NaN (they must never be read)."""
    ring_start = torch.randint(0, R, (S,), dtype=torch.int32)
    beta = torch.rand(S, Hv, R) * 0.9 + 0.05
    cache = Cache(
        (torch.randn(S, Hv, Dk, Dv) * 0.5).to(state_dtype),
        torch.randn(S, Hk, R, Dk).to(act_dtype),
        torch.randn(S, Hv, R, Dv) * beta[..., None],
        -(torch.rand(S, Hv, R) * 0.78 + 0.02),
        ring_start,
        torch.as_tensor(committed, dtype=torch.int32),
    )
    for s in range(S):
        free = [r for r in range(R) if (r - int(ring_start[s])) % R >= int(cache.committed[s])]
        for t in (cache.ring_k, cache.ring_e, cache.ring_g):
            t[s][:, free] = float("nan")
    return cache


def history(cache: Cache, s: int, n: int | None = None):
    """The first n (default committed) ring entries of slot s as the tokens that produced them, from its
    checkpoint: k (n, Hk, Dk), float64 v (n, Hv, Dv) (`values64`), g, beta = 1 (n, Hv)."""
    R = cache.ring_k.shape[2]
    n = int(cache.committed[s]) if n is None else n
    rows = [(int(cache.ring_start[s]) + j) % R for j in range(n)]
    k, e = cache.ring_k[s][:, rows].transpose(0, 1), cache.ring_e[s][:, rows].transpose(0, 1)
    g = cache.ring_g[s][:, rows].T
    return k, values64(cache.state[s], k, e, g), g, torch.ones_like(g)


def replay(cache: Cache, step, idx, W, **kw):
    q = step[0]
    out = poisoned(*step[2].shape, dtype=q.dtype)
    o = gdn_replay_forward(*step, *cache.tensors(), idx, W, out=out, **kw)
    assert o is out
    return o


@pytest.mark.parametrize("Hk,Hv,Dk,Dv", HEADS)
def test_recurrence_matches_transformers(Hk, Hv, Dk, Dv):
    """Our fp32 recurrence equals transformers' torch_recurrent_gated_delta_rule (outputs and final state)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = make_tokens(2, 9, Hk, Hv, Dk, Dv)
    S0 = torch.randn(2, Hv, Dk, Dv)
    o, states = gdn_recurrence_ref(q, k, v, g, beta, S0)
    o_hf, S_hf = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    assert_close(o, o_hf, 1e-5, "o")
    assert_close(states[:, -1], S_hf, 1e-5, "final state")


@pytest.mark.parametrize("act_dtype", [F32, BF16])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", HEADS)
def test_chunked_matches_recurrence(Hk, Hv, Dk, Dv, act_dtype):
    """The chunked WY/UT form equals the per-token recurrence: to 1e-12 in float64, 1e-4 in fp32."""
    q, k, v, g, beta = make_tokens(2, 23, Hk, Hv, Dk, Dv, act_dtype)
    S0 = torch.randn(2, Hv, Dk, Dv)
    o64, states = gdn_recurrence_ref(q, k, v, g, beta, S0, dtype=F64)
    for chunk in (1, 5, 64):
        o, S = gdn_chunked_ref(q, k, v, g, beta, S0, chunk_size=chunk, dtype=F64)
        assert_close(o, o64, 1e-12, f"float64 o, chunk {chunk}")
        assert_close(S, states[:, -1], 1e-12, f"float64 state, chunk {chunk}")
        o, S = gdn_chunked_ref(q, k, v, g, beta, S0, chunk_size=chunk)
        assert o.dtype == F32
        assert_close(o, o64, 1e-4, f"fp32 o, chunk {chunk}")
        assert_close(S, states[:, -1], 1e-4, f"fp32 state, chunk {chunk}")


def packed_rows(lens, Hk, Hv, Dk, Dv):
    """Random packed tokens (q, k, v, g, beta; leading dim T) of rows of the given lengths, and cu_seqlens."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = make_tokens(1, cu[-1], Hk, Hv, Dk, Dv)
    return (q[0], k[0], v[0], g[0], beta[0]), cu


def per_segment(tokens, cu, S0, points, dtype):
    """One gdn_chunked_ref call per (row, segment between its sorted points): (o, {(row, length): state})."""
    o = torch.empty(cu[-1], *tokens[2].shape[1:], dtype=dtype)
    states = {}
    for i in range(len(cu) - 1):
        S, pos = S0[i].to(dtype), 0
        states[(i, 0)] = S
        for c in sorted({n for r, n in points if r == i} | {cu[i + 1] - cu[i]}):
            if c > pos:
                sl = slice(cu[i] + pos, cu[i] + c)
                oc, S = gdn_chunked_ref(*(t[None, sl] for t in tokens), S[None], dtype=dtype)
                o[sl], S, pos = oc[0], S[0], c
            states[(i, c)] = S
    return o, states


# Rows crossing chunk boundaries (64), single tokens, cuts at 0, mid-chunk, a chunk edge, the row end
# and twice at one length; rows 1 and 4 start from zeros.
VARLEN_LENS = [70, 3, 130, 1, 20, 64]
VARLEN_POINTS = [(0, 5), (0, 64), (2, 0), (2, 65), (2, 130), (4, 10), (4, 5), (4, 10), (5, 64)]


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (F32, 2e-6)])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", HEADS)
def test_chunked_varlen_equals_per_segment_calls(Hk, Hv, Dk, Dv, dtype, tol):
    """Rows batched per cut round and right-padded give each segment's own chunked call: outputs and the
    state at every point, to 1e-12 in float64 and fp32 rounding in fp32; the float64 states are the
    recurrence's."""
    tokens, cu = packed_rows(VARLEN_LENS, Hk, Hv, Dk, Dv)
    S0 = torch.randn(len(VARLEN_LENS), Hv, Dk, Dv)
    S0[[1, 4]] = 0.0
    points = [(i, n) for i, n in enumerate(VARLEN_LENS)] + VARLEN_POINTS
    out = poisoned(cu[-1], Hv, Dv, dtype=dtype)
    o, states = gdn_chunked_varlen_ref(*tokens, cu, S0, points, dtype=dtype, out=out)
    assert o is out and states.dtype == dtype and states.shape == (len(points), Hv, Dk, Dv)
    o_ref, states_ref = per_segment(tokens, cu, S0, points, dtype)
    assert_close(o, o_ref, tol, "o")
    for j, p in enumerate(points):
        assert_close(states[j], states_ref[p], tol, f"state at {p}")
    if dtype == F64:
        for j, (i, n) in enumerate(points):
            row = [t[cu[i]:cu[i] + n] for t in tokens]
            assert_close(states[j], advance(S0[i], *row[1:]), 1e-12, f"recurrence state at {(i, n)}")


def test_chunked_varlen_length_groups_bound_padding():
    """One long row among many short ones splits the rows into length groups, each padded to at most 4x
    its real tokens, with the same float64 outputs and states as the per-segment calls."""
    lens = [3, 200, 5, 2, 4, 3, 6, 2, 3]
    groups = _length_groups(lens)
    assert len(groups) > 1 and sorted(i for gr in groups for i in gr) == list(range(len(lens)))
    assert all(len(gr) * max(lens[i] for i in gr) <= 4 * sum(lens[i] for i in gr) for gr in groups)
    tokens, cu = packed_rows(lens, 1, 4, 32, 16)
    S0 = torch.randn(len(lens), 4, 32, 16)
    points = [(i, n) for i, n in enumerate(lens)] + [(1, 100), (2, 1)]
    o, states = gdn_chunked_varlen_ref(*tokens, cu, S0, points, dtype=F64)
    o_ref, states_ref = per_segment(tokens, cu, S0, points, F64)
    assert_close(o, o_ref, 1e-12, "o")
    for j, p in enumerate(points):
        assert_close(states[j], states_ref[p], 1e-12, f"state at {p}")


def test_chunked_varlen_rejects_points_outside_rows():
    """A point past its row's end (or naming no row) is a ValueError naming points."""
    tokens, cu = packed_rows([4, 6], 2, 2, 16, 16)
    S0 = torch.randn(2, 2, 16, 16)
    for bad in [(0, 5), (2, 1), (1, -1)]:
        with pytest.raises(ValueError, match="points"):
            gdn_chunked_varlen_ref(*tokens, cu, S0, [bad])


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("state_dtype,act_dtype", [(F32, F32), (BF16, BF16), (F32, BF16)])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", HEADS)
def test_replay_forward_matches_recurrence(Hk, Hv, Dk, Dv, state_dtype, act_dtype, n):
    """For every ring fill 0..W: outputs equal the recurrence from checkpoint + history, the state is
    written iff h + n > W (with the history's state), the appended e are the recurrence's deltas (k, g
    exact), nothing else changes."""
    W = 6
    R, S = W + n, W + 4
    idx = torch.randperm(S)[: W + 1].to(torch.int32)
    idx = torch.cat([idx[:2], torch.tensor([-1], dtype=torch.int32), idx[2:]])
    committed = torch.randint(0, W + 1, (S,))
    for h, s in enumerate(idx[idx >= 0].tolist()):
        committed[s] = h
    cache = make_cache(S, Hk, Hv, Dk, Dv, R, committed, state_dtype, act_dtype)
    before = cache.clone()
    step = make_tokens(len(idx), n, Hk, Hv, Dk, Dv, act_dtype)
    o = replay(cache, step, idx, W, rand_seed=seed_tensor(3))

    q, k, v, g, beta = step
    assert torch.equal(o[2], torch.zeros_like(o[2])), "padding row output must be zero"
    appended = torch.zeros(S, R, dtype=torch.bool)
    for i, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        h, start = int(before.committed[s]), int(before.ring_start[s])
        S_hist = advance(before.state[s], *history(before, s))
        o_ref = run64(S_hist, q[i], k[i], v[i], g[i], beta[i])[0]
        assert_close(o[i], o_ref, ACT_TOL[act_dtype], f"o row {i}, h = {h}")
        e_ref = deltas64(S_hist, k[i], v[i], g[i], beta[i])
        if h + n > W:
            assert_close(cache.state[s], S_hist, STATE_TOL[state_dtype], f"flushed state, h = {h}")
        else:
            assert torch.equal(bits(cache.state[s]), bits(before.state[s])), f"h = {h} must not flush"
        rows = [(start + h + t) % R for t in range(n)]
        appended[s, rows] = True
        assert_close(cache.ring_e[s][:, rows].transpose(0, 1), e_ref, STATE_TOL[F32], f"e row {i}, h = {h}")
        for name, new in zip(("ring_k", "ring_g"), (k[i], g[i])):
            assert torch.equal(bits(getattr(cache, name)[s][:, rows]), bits(new.transpose(0, 1))), name
    untouched = [s for s in range(S) if s not in idx.tolist()]
    assert torch.equal(bits(cache.state[untouched]), bits(before.state[untouched]))
    for name in ("ring_k", "ring_e", "ring_g"):
        old, new = bits(getattr(before, name)), bits(getattr(cache, name))
        keep = ~appended[:, None, :, None] if old.dim() == 4 else ~appended[:, None, :]
        assert torch.equal(torch.where(keep, new, 0), torch.where(keep, old, 0)), name
    assert torch.equal(cache.ring_start, before.ring_start) and torch.equal(cache.committed, before.committed)


@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", HEADS[1:])
def test_partial_acceptance_materializes_recurrence_state(Hk, Hv, Dk, Dv, state_dtype):
    """After a verify step of 4 tokens with m accepted, materializing every committed entry gives the
    recurrence's state after history + m tokens, flushed or not; the source slot is untouched."""
    W, n = 6, 4
    R, S = W + n, 8
    for m in range(1, n + 1):
        cache = make_cache(S, Hk, Hv, Dk, Dv, R, [1, W, 0, 2, 0, 0, 0, 0], state_dtype, BF16)
        idx = torch.tensor([3, 1], dtype=torch.int32)  # h = 2 (no flush), h = W (flush)
        before = cache.clone()
        step = make_tokens(2, n, Hk, Hv, Dk, Dv, BF16)
        replay(cache, step, idx, W)
        replay_commit(cache.ring_start, cache.committed, idx, torch.tensor([m, m], dtype=torch.int32), n, W,
                      ring_rows=R)
        kept = cache.clone()
        src, dst = idx, torch.tensor([5, 6], dtype=torch.int32)
        gdn_replay_materialize(*cache.tensors(), src, cache.committed[src.long()].clone(), dst)
        for i, (s, d) in enumerate(zip(src.tolist(), dst.tolist())):
            hist = history(before, s)
            accepted = [torch.cat([a, b[i, :m]]) for a, b in zip(hist, step[1:])]
            want = advance(before.state[s], *accepted)
            assert_close(cache.state[d], want, STATE_TOL[state_dtype], f"m = {m}, slot {s}")
        for a, b in zip(cache.tensors()[1:], kept.tensors()[1:]):
            assert torch.equal(bits(a), bits(b)), "materialize writes only the destination states"
        assert torch.equal(bits(cache.state[src.long()]), bits(kept.state[src.long()]))


@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_materialize_any_ring_position(state_dtype):
    """dst = src checkpoint advanced by n entries for every n in 0..committed (n = 0 copies exactly)."""
    Hk, Hv, Dk, Dv, W, S = 2, 4, 16, 8, 5, 4
    cache = make_cache(S, Hk, Hv, Dk, Dv, W + 2, [W, 0, 0, 0], state_dtype, BF16)
    for count in range(W + 1):
        trial = cache.clone()
        src, dst = torch.tensor([0, -1], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32)
        gdn_replay_materialize(*trial.tensors(), src, torch.tensor([count, 1], dtype=torch.int32), dst)
        if count == 0:
            assert torch.equal(bits(trial.state[2]), bits(cache.state[0])), "n = 0 is an exact copy"
        want = advance(cache.state[0], *history(cache, 0, count))
        assert_close(trial.state[2], want, STATE_TOL[state_dtype], f"n = {count}")
        assert torch.equal(bits(trial.state[[0, 1, 3]]), bits(cache.state[[0, 1, 3]]))


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", HEADS)
def test_replay_steps_follow_accepted_tokens(Hk, Hv, Dk, Dv, n):
    """Twelve steps of n tokens with random acceptance: every output, and every state materialized from
    checkpoint + committed entries, equals the float64 recurrence over exactly the accepted tokens, through
    several flushes and ring wrap-arounds."""
    W, S = 5, 4
    R = W + n
    cache = make_cache(S, Hk, Hv, Dk, Dv, R, [0, 0, 0, 0], F32, F32)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    S_acc = {s: cache.state[s].double() for s in (2, 0)}  # float64 state after every accepted token
    for _ in range(12):
        step = make_tokens(2, n, Hk, Hv, Dk, Dv)
        o = replay(cache, step, idx, W)
        acc = torch.randint(1, n + 1, (2,), dtype=torch.int32)
        for i, s in enumerate(idx.tolist()):
            o64, states = run64(S_acc[s], *(t[i] for t in step))
            assert_close(o[i], o64, 1e-4, f"slot {s}")
            S_acc[s] = states[int(acc[i]) - 1]
        replay_commit(cache.ring_start, cache.committed, idx, acc, n, W, ring_rows=R)
        for s in idx.tolist():
            dst = torch.tensor([1], dtype=torch.int32)
            gdn_replay_materialize(*cache.tensors(), torch.tensor([s], dtype=torch.int32),
                                   cache.committed[[s]].clone(), dst)
            assert_close(cache.state[1], S_acc[s], 1e-4, f"materialized slot {s}")


def test_replay_decode_equals_baseline_decode():
    """Forty one-token steps: ReplaySSM (ring of deltas, flushes every W) and the baseline state update give
    the same outputs, and the materialized state equals the baseline's state."""
    Hk, Hv, Dk, Dv, W = 1, 4, 16, 8, 6
    cache = make_cache(3, Hk, Hv, Dk, Dv, W + 1, [0, 0, 0], F32, F32)
    plain = cache.state.clone()
    idx = torch.tensor([0, 2], dtype=torch.int32)
    for _ in range(40):
        step = make_tokens(2, 1, Hk, Hv, Dk, Dv)
        o = replay(cache, step, idx, W)
        replay_commit(cache.ring_start, cache.committed, idx, torch.ones(2, dtype=torch.int32), 1, W,
                      ring_rows=W + 1)
        assert_close(o, gdn_state_update(plain, *step, idx), 1e-5, "outputs")
    gdn_replay_materialize(*cache.tensors(), idx[:1], cache.committed[[0]].clone(),
                           torch.tensor([1], dtype=torch.int32))
    assert_close(cache.state[1], plain[0], 1e-5, "state")


@pytest.mark.parametrize("state_dtype", [F32, BF16])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", HEADS)
def test_baseline_decode_and_verify(Hk, Hv, Dk, Dv, state_dtype):
    """Baseline: q = 1 writes the next state in place; verify writes the state after each token to its own
    slot (-1 skips), reading every source first; outputs equal the recurrence."""
    S = 10
    state = (torch.randn(S, Hv, Dk, Dv) * 0.5).to(state_dtype)
    before = state.clone()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    step = make_tokens(3, 1, Hk, Hv, Dk, Dv, BF16)
    o = gdn_state_update(state, *step, idx, out=poisoned(3, 1, Hv, Dv, dtype=BF16))
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    for i, s in ((0, 4), (2, 1)):
        o_ref, states = run64(before[s], *(t[i] for t in step))
        assert_close(o[i], o_ref, ACT_TOL[BF16], "decode o")
        assert_close(state[s], states[-1], STATE_TOL[state_dtype], "decode state")
    assert torch.equal(bits(state[[0, 2, 3, 5, 6, 7, 8, 9]]), bits(before[[0, 2, 3, 5, 6, 7, 8, 9]]))

    state = before.clone()
    n = 4
    step = make_tokens(2, n, Hk, Hv, Dk, Dv, F32)
    idx = torch.tensor([1, 4], dtype=torch.int32)
    dst = torch.tensor([[1, 0, 2, 3], [5, 6, -1, 4]], dtype=torch.int32)  # a source is also a destination
    o = gdn_state_update(state, *step, idx, dst_indices=dst, out=poisoned(2, n, Hv, Dv))
    for i, s in enumerate(idx.tolist()):
        o_ref, states = run64(before[s], *(t[i] for t in step))
        assert_close(o[i], o_ref, ACT_TOL[F32], "verify o")
        for t, d in enumerate(dst[i].tolist()):
            if d >= 0:
                assert_close(state[d], states[t], STATE_TOL[state_dtype], f"state after token {t}")
    assert torch.equal(bits(state[[7, 8, 9]]), bits(before[[7, 8, 9]]))


def test_bf16_writes_are_stochastic_roundings_of_fp32():
    """Every bf16 state write (flush, materialize, baseline) is round_states of the fp32-pool result."""
    Hk, Hv, Dk, Dv, W, S, n = 1, 2, 16, 8, 4, 6, 2
    low = make_cache(S, Hk, Hv, Dk, Dv, W + n, [W, 1, 0, 2, 0, 0], BF16, BF16)
    high = low.clone()
    high.state = high.state.float()  # the same checkpoint values in an fp32 pool
    seed, idx = seed_tensor(7), torch.tensor([0, 3], dtype=torch.int32)
    step = make_tokens(2, n, Hk, Hv, Dk, Dv, BF16)
    slots = torch.tensor([0, 3, 4, 5])
    for cache in (low, high):
        replay(cache, step, idx, W, rand_seed=seed)  # slot 0 flushes, slot 3 does not
        gdn_replay_materialize(*cache.tensors(), torch.tensor([3], dtype=torch.int32),
                               torch.tensor([2], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                               rand_seed=seed)
        gdn_state_update(cache.state, *step, torch.tensor([1, 2], dtype=torch.int32),
                         dst_indices=torch.tensor([[5, -1], [-1, -1]], dtype=torch.int32), rand_seed=seed)
    want = round_states(high.state[slots], slots, BF16, seed)
    assert torch.equal(bits(low.state[slots]), bits(want))
    assert not torch.equal(bits(want), bits(high.state[slots].to(BF16))), "differs from round-to-nearest"


def _replay_args(**over):
    Hk, Hv, Dk, Dv, W, S, n = 1, 2, 8, 8, 4, 5, 2
    cache = make_cache(S, Hk, Hv, Dk, Dv, W + n, [1, 2, 3, 4, 0], F32, F32)
    q, k, v, g, beta = make_tokens(2, n, Hk, Hv, Dk, Dv)
    names = ("state", "ring_k", "ring_e", "ring_g", "ring_start", "committed")
    args = dict(q=q, k=k, v=v, g=g, beta=beta, **dict(zip(names, cache.tensors())),
                state_indices=torch.tensor([3, -1], dtype=torch.int32), window=W)
    args.update(over)
    return args


REPLAY_BAD = [
    ("q", dict(window=1)),  # 2 tokens per row > window
    ("ring_k", dict(window=5)),  # R = 6 < window + 2
    ("k", dict(k=torch.randn(2, 2, 1, 8).bfloat16())),
    ("v", dict(v=torch.randn(2, 2, 3, 8))),
    ("g", dict(g=torch.randn(2, 1, 2))),
    ("ring_g", dict(ring_g=torch.rand(5, 2, 6).bfloat16())),
    ("ring_e", dict(ring_e=torch.rand(5, 2, 6, 8).bfloat16())),  # e is fp32 whatever the activations
    ("state_indices", dict(state_indices=torch.tensor([2, 2], dtype=torch.int32))),
    ("committed", dict(committed=torch.tensor([0, 0, 0, 5, 0], dtype=torch.int32))),
]


@pytest.mark.parametrize("name,over", REPLAY_BAD)
def test_replay_forward_rejects_bad_arguments(name, over):
    """gdn_replay_forward raises ValueError naming the bad argument."""
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}:"):
        gdn_replay_forward(**_replay_args(**over))


def test_materialize_and_baseline_reject_bad_arguments():
    """gdn_replay_materialize and gdn_state_update raise ValueError naming the bad argument."""
    args = _replay_args()
    cache = [args[k] for k in ("state", "ring_k", "ring_e", "ring_g", "ring_start", "committed")]
    one = torch.tensor([0], dtype=torch.int32)
    for name, src, cnt, dst in [("num_entries", one, torch.tensor([2], dtype=torch.int32), one + 2),
                                ("dst_indices", one, one, one),
                                ("src_indices", one + 5, one, one + 2)]:
        with pytest.raises(ValueError, match=rf"^{name}:"):
            gdn_replay_materialize(*cache, src, cnt, dst)
    step = [args[k] for k in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=r"^dst_indices:"):
        gdn_state_update(args["state"], *step, args["state_indices"],
                         dst_indices=torch.tensor([[0, 0], [1, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^k:"):
        gdn_state_update(args["state"], step[0], torch.randn(2, 2, 1, 4), *step[2:], args["state_indices"])
