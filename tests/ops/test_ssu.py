"""Baseline selective state update (plain decode and per-draft verify states) vs the float64 oracle."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import assert_close, bits, poisoned
from ssm_oracle import softplus_dt, ssm_recurrence
from test_replay import ACT_TOL, BF16, CASES, F32, STATE_TOL, make_params, make_step

from replayssm.ops.common import softplus_dt as softplus_dt_fp32
from replayssm.ops.rounding import seed_tensor
from replayssm.ops.ssu import selective_state_update, selective_state_update_ref


def run_ssu(state, step, params, idx, **kw):
    x, dt, B, C = step
    A, D, dt_bias = params
    out = poisoned(*x.shape, dtype=x.dtype)
    y = selective_state_update(state, x, dt, A, B, C, D, dt_bias, idx, out=out, **kw)
    assert y is out
    return y


def slots_with_padding(S: int, n: int, pad_at: int) -> torch.Tensor:
    s = torch.randperm(S)[:n].tolist()
    return torch.tensor(s[:pad_at] + [-1] + s[pad_at:], dtype=torch.int32)


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("H,G,P,N,state_dtype,act_dtype", CASES)
def test_ssu_matches_oracle(H, G, P, N, state_dtype, act_dtype, q):
    """q tokens from state[s]: outputs and final state match the oracle; other slots bit-exact."""
    S = 8
    params = make_params(H)
    A, D, dt_bias = params
    state = torch.randn(S, H, P, N).to(state_dtype)
    before = state.clone()
    idx = slots_with_padding(S, 3, pad_at=2)
    step = make_step(len(idx), q, H, G, P, N, act_dtype)
    y = run_ssu(state, step, params, idx, rand_seed=seed_tensor(3))
    x, dt, B, C = step
    for i, s in enumerate(idx.tolist()):
        if s < 0:
            assert torch.equal(y[i], torch.zeros_like(y[i])), "padding row output must be zero"
            continue
        y_ref, S_ref, _ = ssm_recurrence(before[s], x[i], softplus_dt(dt[i], dt_bias), A, B[i], C[i], D)
        assert_close(y[i], y_ref, ACT_TOL[act_dtype], f"y row {i}")
        assert_close(state[s], S_ref, STATE_TOL[state_dtype], f"state of slot {s}")
    untouched = [s for s in range(S) if s not in idx.tolist()]
    assert torch.equal(bits(state[untouched]), bits(before[untouched]))


def test_plain_decode_steps_match_oracle():
    """Token-by-token decode (read + write every step) equals the oracle over the whole sequence."""
    H, G, P, N, S, steps = 4, 2, 16, 32, 5, 6
    params = make_params(H)
    A, D, dt_bias = params
    state = torch.randn(S, H, P, N)
    start = state.clone()
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)
    inputs = [make_step(3, 1, H, G, P, N, F32) for _ in range(steps)]
    ys = [run_ssu(state, step, params, idx) for step in inputs]
    for i in (0, 2):
        s = int(idx[i])
        x, dt, B, C = (torch.cat([step[k][i] for step in inputs]) for k in range(4))
        y_ref, S_ref, _ = ssm_recurrence(start[s], x, softplus_dt(dt, dt_bias), A, B, C, D)
        assert_close(torch.cat([y[i] for y in ys]), y_ref, 1e-4, f"row {i}")
        assert_close(state[s], S_ref, 1e-4, f"slot {s}")


@pytest.mark.parametrize("state_dtype,act_dtype", [(F32, F32), (BF16, BF16)])
def test_verify_writes_state_after_each_token(state_dtype, act_dtype):
    """dst_indices: state after token t lands in dst[i, t]; -1 skips; sources are read before any write."""
    H, G, P, N, q, S = 8, 1, 32, 16, 3, 12
    params = make_params(H)
    A, D, dt_bias = params
    state = torch.randn(S, H, P, N).to(state_dtype)
    before = state.clone()
    idx = torch.tensor([4, -1, 9], dtype=torch.int32)
    # Row 2's first draft overwrites row 0's source slot 4: reads must come first.
    dst = torch.tensor([[1, -1, 7], [2, 3, 5], [4, 11, 0]], dtype=torch.int32)
    step = make_step(3, q, H, G, P, N, act_dtype)
    y = run_ssu(state, step, params, idx, dst_indices=dst)
    x, dt, B, C = step
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    written = []
    for i in (0, 2):
        s = int(idx[i])
        y_ref, _, after = ssm_recurrence(before[s], x[i], softplus_dt(dt[i], dt_bias), A, B[i], C[i], D)
        assert_close(y[i], y_ref, ACT_TOL[act_dtype], f"y row {i}")
        for t in range(q):
            d = int(dst[i, t])
            if d >= 0:
                written.append(d)
                assert_close(state[d], after[t], STATE_TOL[state_dtype], f"row {i} token {t}")
    other = [s for s in range(S) if s not in written]
    assert torch.equal(bits(state[other]), bits(before[other])), "padding row and unlisted slots untouched"


def test_verify_keeps_state_at_last_accepted_token():
    """Continuing decode from dst[i, a-1] equals the oracle over exactly the a accepted tokens + the next."""
    H, G, P, N, q, S = 4, 2, 16, 16, 4, 16
    params = make_params(H)
    A, D, dt_bias = params
    state = torch.randn(S, H, P, N)
    start = state.clone()
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    dst = torch.arange(3, 3 + 3 * q, dtype=torch.int32).view(3, q)
    verify = make_step(3, q, H, G, P, N, F32)
    run_ssu(state, verify, params, idx, dst_indices=dst)
    accepted = [1, 4, 2]
    keep = torch.tensor([int(dst[i, a - 1]) for i, a in enumerate(accepted)], dtype=torch.int32)
    nxt = make_step(3, 1, H, G, P, N, F32)
    y = run_ssu(state, nxt, params, keep)
    for i, a in enumerate(accepted):
        x, dt, B, C = (torch.cat([verify[k][i, :a], nxt[k][i]]) for k in range(4))
        y_ref, S_ref, _ = ssm_recurrence(start[i], x, softplus_dt(dt, dt_bias), A, B, C, D)
        assert_close(y[i], y_ref[a:], 1e-4, f"row {i} next output")
        assert_close(state[int(keep[i])], S_ref, 1e-4, f"row {i} kept state")


def test_public_op_equals_ref_and_softplus_switch():
    """On CPU the public op is the reference (bit-identical); dt_softplus=False uses dt + dt_bias as Δ."""
    H, G, P, N, S = 4, 1, 8, 16, 4
    params = make_params(H)
    A, D, dt_bias = params
    state = torch.randn(S, H, P, N).half()
    start, twin = state.clone(), state.clone()
    idx = torch.tensor([2, 0], dtype=torch.int32)
    x, dt, B, C = make_step(2, 2, H, G, P, N, F32)
    dt = dt.abs() + 2.0  # keep dt + dt_bias > 0 so it is a valid Δ without softplus
    y = run_ssu(state, (x, dt, B, C), params, idx, dt_softplus=False, rand_seed=seed_tensor(9))
    y_ref = selective_state_update_ref(twin, x, dt, A, B, C, D, dt_bias, idx, dt_softplus=False,
                                       rand_seed=seed_tensor(9))
    assert torch.equal(bits(y), bits(y_ref)) and torch.equal(bits(state), bits(twin))
    want = ssm_recurrence(start[2], x[0], dt[0].double() + dt_bias.double(), A, B[0], C[0], D)[0]
    assert_close(y[0], want, 1e-4, "y with dt_softplus=False")


def test_softplus_dt_identity_above_20():
    """softplus_dt is fp32 softplus(dt + dt_bias), exactly the identity above 20."""
    dt = torch.tensor([[-30.0, -1.0, 0.0, 19.0, 20.5, 40.0]])
    bias = torch.zeros(6)
    got = softplus_dt_fp32(dt, bias)
    assert got.dtype == torch.float32
    assert torch.equal(got[0, 4:], dt[0, 4:])
    assert_close(got, softplus_dt(dt, bias), 1e-6, "softplus")
    assert torch.equal(softplus_dt_fp32(dt.bfloat16(), bias, dt_softplus=False), dt.bfloat16().float())


SSU_BAD = [
    ("state_indices", dict(state_indices=torch.tensor([6, 0], dtype=torch.int32))),
    ("state_indices", dict(state_indices=torch.tensor([1, 1], dtype=torch.int32))),
    ("dst_indices", dict(dst_indices=torch.tensor([[1, 2]], dtype=torch.int32))),
    ("dst_indices", dict(dst_indices=torch.tensor([[1, 2], [3, 1]], dtype=torch.int32))),
    ("B", dict(B=torch.randn(2, 2, 2, 16).bfloat16())),
    ("C", dict(C=torch.randn(2, 2, 1, 16))),
    ("x", dict(x=torch.randn(2, 2, 3, 8))),
    ("D", dict(D=torch.randn(4).double())),
    ("dt_bias", dict(dt_bias=torch.randn(5))),
    ("out", dict(out=torch.empty(2, 2, 4, 4))),
    ("B", dict(B=torch.randn(2, 2, 3, 16), C=torch.randn(2, 2, 3, 16))),  # 3 groups for 4 heads
]


@pytest.mark.parametrize("name,over", SSU_BAD)
def test_ssu_rejects_bad_arguments(name, over):
    """selective_state_update raises ValueError naming the bad argument."""
    H, G, P, N = 4, 2, 8, 16
    A, D, dt_bias = make_params(H)
    x, dt, B, C = make_step(2, 2, H, G, P, N, F32)
    args = dict(state=torch.randn(6, H, P, N), x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias,
                state_indices=torch.tensor([3, -1], dtype=torch.int32))
    args.update(over)
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}:"):
        selective_state_update(**args)
