"""Causal depthwise conv1d: varlen prefill, speculative update and commit vs the float64 oracle."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from hypothesis import given, settings
from hypothesis import strategies as st
from ssm_oracle import conv1d_recurrence

from replayssm.ops.conv1d import (
    causal_conv1d_commit,
    causal_conv1d_commit_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    causal_conv1d_varlen,
    causal_conv1d_varlen_ref,
)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _params(D: int, K: int, dtype: torch.dtype, with_bias: bool = True):
    weight = (torch.randn(D, K) / K).to(dtype)
    bias = torch.randn(D).to(dtype) if with_bias else None
    return weight, bias


def _pool(S: int, D: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(S, D, K - 1).to(dtype)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _slots(S: int, n: int, pad_rows: tuple[int, ...] = ()) -> torch.Tensor:
    """n distinct permuted slots of a pool of S, with -1 at pad_rows."""
    s = torch.randperm(S)[:n].to(torch.int32)
    for r in pad_rows:
        s[r] = -1
    return s


@pytest.mark.parametrize(
    "D, K, dtype, activation",
    [(32, 4, torch.float32, "silu"), (48, 4, torch.bfloat16, "silu"), (16, 2, torch.float32, None)],
)
def test_varlen_matches_oracle(D, K, dtype, activation):
    """Varlen prefill equals the per-sequence oracle (outputs and final windows), short sequences included."""
    lengths = [5, 1, 7, 0, 13, 2, 3]
    n, S = len(lengths), 12
    weight, bias = _params(D, K, dtype)
    pool = _pool(S, D, K, dtype)
    slots = _slots(S, n, pad_rows=(2,))
    has_init = torch.tensor([True, True, False, True, False, True, False])
    # A slot without initial state must not be read: poison it.
    for i in range(n):
        if slots[i] >= 0 and not has_init[i]:
            pool[slots[i]] = float("nan")
    before = pool.clone()
    cu = _cu(lengths)
    x = torch.randn(cu[-1].item(), D).to(dtype)
    y = causal_conv1d_varlen(x, weight, bias, pool, cu, slots, has_init, activation)
    assert y.dtype == dtype and y.shape == x.shape
    written = set()
    for i in range(n):
        seg = slice(cu[i].item(), cu[i + 1].item())
        s = slots[i].item()
        if s < 0:
            assert bool((y[seg] == 0).all())
            continue
        written.add(s)
        win0 = before[s] if has_init[i] else torch.zeros(D, K - 1)
        y_ref, win_ref = conv1d_recurrence(win0, x[seg], weight, bias, activation)
        torch.testing.assert_close(y[seg].double(), y_ref, **TOL[dtype])
        # The window holds raw inputs, so it is copied exactly.
        torch.testing.assert_close(pool[s].double(), win_ref.to(dtype).double(), atol=0, rtol=0)
    for s in range(S):
        if s not in written:
            assert torch.equal(pool[s].nan_to_num(7.0), before[s].nan_to_num(7.0)), s


def test_varlen_public_equals_ref_and_empty_batch():
    """The public op equals its _ref twin on CPU; a batch with zero tokens writes zero-padded windows."""
    D, K, S = 8, 4, 5
    weight, bias = _params(D, K, torch.float32)
    pool = _pool(S, D, K, torch.float32)
    pool2 = pool.clone()
    cu = _cu([3, 9])
    slots = torch.tensor([4, 1], dtype=torch.int32)
    init = torch.tensor([True, False])
    x = torch.randn(12, D)
    a = causal_conv1d_varlen(x, weight, bias, pool, cu, slots, init)
    b = causal_conv1d_varlen_ref(x, weight, bias, pool2, cu, slots, init)
    assert torch.equal(a, b) and torch.equal(pool, pool2)
    y = causal_conv1d_varlen(
        x[:0], weight, bias, pool, _cu([0]), torch.tensor([3], dtype=torch.int32), init[1:]
    )
    assert y.shape == (0, D) and bool((pool[3] == 0).all())


@settings(deadline=None, max_examples=15)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    K=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_varlen_random_lengths_match_oracle(lengths, K, seed):
    """For random lengths (often shorter than K-1) and kernel widths, outputs and windows match the oracle."""
    torch.manual_seed(seed)
    D, n = 6, len(lengths)
    S = n + 3
    weight, bias = _params(D, K, torch.float32)
    pool = _pool(S, D, K, torch.float32)
    before = pool.clone()
    slots = _slots(S, n)
    has_init = torch.rand(n) < 0.7
    cu = _cu(lengths)
    x = torch.randn(int(cu[-1]), D)
    y = causal_conv1d_varlen(x, weight, bias, pool, cu, slots, has_init)
    for i in range(n):
        seg = slice(int(cu[i]), int(cu[i + 1]))
        win0 = before[slots[i]] if has_init[i] else torch.zeros(D, K - 1)
        y_ref, win_ref = conv1d_recurrence(win0, x[seg], weight, bias)
        torch.testing.assert_close(y[seg].double(), y_ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(pool[slots[i]].double(), win_ref)


@pytest.mark.parametrize("q, dtype", [(1, torch.float32), (4, torch.float32), (3, torch.bfloat16)])
def test_update_matches_oracle_and_keeps_window(q, dtype):
    """Multi-token update gives the oracle outputs and leaves every window bit-exact."""
    D, K, S, b = 24, 4, 9, 5
    weight, bias = _params(D, K, dtype)
    pool = _pool(S, D, K, dtype)
    before = pool.clone()
    slots = _slots(S, b, pad_rows=(1,))
    x = torch.randn(b, q, D).to(dtype)
    y = causal_conv1d_update(x, weight, bias, pool, slots)
    assert torch.equal(pool, before)
    for i in range(b):
        s = slots[i].item()
        if s < 0:
            assert bool((y[i] == 0).all())
            continue
        y_ref, _ = conv1d_recurrence(before[s], x[i], weight, bias)
        torch.testing.assert_close(y[i].double(), y_ref, **TOL[dtype])


@pytest.mark.parametrize("use_dst", [False, True])
def test_commit_keeps_window_at_last_accepted(use_dst):
    """Commit writes the last K-1 of [window, x[:a]] (a = 0..q) to dst; other slots stay bit-exact."""
    D, K, S, b, q = 16, 4, 14, 6, 5
    pool = _pool(S, D, K, torch.bfloat16)
    perm = torch.randperm(S).to(torch.int32)
    slots = perm[:b].clone()
    slots[3] = -1
    num_acc = torch.tensor([1, 5, 2, 4, 0, 3], dtype=torch.int32)
    dst = None
    if use_dst:
        dst = perm[b : 2 * b].clone()
        dst[5] = -1
        pool[dst[dst >= 0].long()] = float("nan")  # every dst element must be written
    before = pool.clone()
    x = torch.randn(b, q, D).to(torch.bfloat16)
    causal_conv1d_commit(pool, x, num_acc, slots, dst)
    targets = slots if dst is None else dst
    for i in range(b):
        s, t = slots[i].item(), targets[i].item()
        if s < 0 or t < 0:
            continue
        _, win = conv1d_recurrence(before[s], x[i, : num_acc[i]], torch.ones(D, K), None)
        assert torch.equal(pool[t], win.to(torch.bfloat16)), i
    touched = {targets[i].item() for i in range(b) if slots[i] >= 0 and targets[i] >= 0}
    for s in set(range(S)) - touched:
        assert torch.equal(pool[s].nan_to_num(7.0), before[s].nan_to_num(7.0)), s


def test_commit_reads_before_writes():
    """Rows whose dst is another row's src still see the pre-commit windows (swap two slots)."""
    D, K, q = 8, 4, 3
    pool = _pool(4, D, K, torch.float32)
    before = pool.clone()
    x = torch.randn(2, q, D)
    src = torch.tensor([0, 1], dtype=torch.int32)
    causal_conv1d_commit(
        pool, x, torch.tensor([2, 1], dtype=torch.int32), src, torch.tensor([1, 0], dtype=torch.int32)
    )
    _, w0 = conv1d_recurrence(before[0], x[0, :2], torch.ones(D, K), None)
    _, w1 = conv1d_recurrence(before[1], x[1, :1], torch.ones(D, K), None)
    assert torch.equal(pool[1], w0.float()) and torch.equal(pool[0], w1.float())


def test_update_then_commit_equals_prefill():
    """Several update+commit steps with random acceptance equal one varlen prefill of the accepted tokens."""
    D, K, S, b, q, steps = 20, 4, 7, 3, 4, 5
    weight, bias = _params(D, K, torch.float32)
    pool = _pool(S, D, K, torch.float32)
    start = pool.clone()
    slots = torch.tensor([5, 0, 3], dtype=torch.int32)
    accepted_x = [[] for _ in range(b)]
    accepted_y = [[] for _ in range(b)]
    for _ in range(steps):
        x = torch.randn(b, q, D)
        y = causal_conv1d_update(x, weight, bias, pool, slots)
        a = torch.randint(1, q + 1, (b,), dtype=torch.int32)
        causal_conv1d_commit(pool, x, a, slots)
        for i in range(b):
            accepted_x[i].append(x[i, : a[i]])
            accepted_y[i].append(y[i, : a[i]])
    ref_pool = start.clone()
    xs = [torch.cat(v) for v in accepted_x]
    cu = _cu([v.shape[0] for v in xs])
    y_pre = causal_conv1d_varlen(
        torch.cat(xs), weight, bias, ref_pool, cu, slots, torch.ones(b, dtype=torch.bool)
    )
    torch.testing.assert_close(torch.cat([torch.cat(v) for v in accepted_y]), y_pre, atol=1e-6, rtol=1e-6)
    assert torch.equal(pool, ref_pool)


def _good_varlen():
    D, K = 8, 4
    w, bias = _params(D, K, torch.float32)
    return dict(
        x=torch.randn(6, D),
        weight=w,
        bias=bias,
        conv_state=_pool(4, D, K, torch.float32),
        cu_seqlens=_cu([2, 4]),
        state_indices=torch.tensor([0, 2], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False]),
    )


@pytest.mark.parametrize(
    "name, bad",
    [
        ("weight", torch.randn(7, 4)),
        ("bias", torch.randn(3)),
        ("conv_state", torch.randn(4, 8, 2)),
        ("cu_seqlens", torch.tensor([0, 2, 5], dtype=torch.int32)),
        ("cu_seqlens", torch.tensor([0, 2, 6], dtype=torch.int64)),
        ("state_indices", torch.tensor([0, 4], dtype=torch.int32)),
        ("state_indices", torch.tensor([2, 2], dtype=torch.int32)),
        ("has_initial_state", torch.tensor([1, 0], dtype=torch.int32)),
        ("activation", "relu"),
    ],
)
def test_varlen_bad_arguments_raise(name, bad):
    """Bad varlen arguments raise ValueError naming the argument."""
    args = _good_varlen()
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        causal_conv1d_varlen(**args)


@pytest.mark.parametrize(
    "name, bad",
    [
        ("x", torch.randn(2, 3)),
        ("num_accepted", torch.tensor([1, 4], dtype=torch.int32)),
        ("num_accepted", torch.tensor([1, 1], dtype=torch.int64)),
        ("state_indices", torch.tensor([0, 9], dtype=torch.int32)),
        ("dst_indices", torch.tensor([1, 1], dtype=torch.int32)),
    ],
)
def test_update_commit_bad_arguments_raise(name, bad):
    """Bad update/commit arguments raise ValueError naming the argument."""
    D, K = 8, 4
    args = dict(
        conv_state=_pool(4, D, K, torch.float32),
        x=torch.randn(2, 3, D),
        num_accepted=torch.tensor([1, 3], dtype=torch.int32),
        state_indices=torch.tensor([0, 2], dtype=torch.int32),
        dst_indices=None,
    )
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        causal_conv1d_commit(**args)
    if name in ("x", "state_indices"):
        w, bias = _params(D, K, torch.float32)
        with pytest.raises(ValueError, match=name):
            causal_conv1d_update(args["x"], w, bias, args["conv_state"], args["state_indices"])


@pytest.mark.parametrize("q", [1, 2, 5])
def test_update_advance_window_equals_commit_of_all(q):
    """advance_window gives the plain update's outputs and the windows of a commit with a = q;
    padding rows and other slots stay bit-exact, and a repeated live slot is refused."""
    D, K, S, b = 20, 4, 11, 6
    weight, bias = _params(D, K, torch.bfloat16)
    pool = _pool(S, D, K, torch.bfloat16)
    slots = _slots(S, b, pad_rows=(2,))
    x = torch.randn(b, q, D).to(torch.bfloat16)
    want_pool = pool.clone()
    want = causal_conv1d_update(x, weight, bias, want_pool, slots)
    causal_conv1d_commit(want_pool, x, torch.full((b,), q, dtype=torch.int32), slots)
    got = causal_conv1d_update(x, weight, bias, pool, slots, advance_window=True)
    assert torch.equal(got, want) and torch.equal(pool, want_pool)
    dup = slots.clone()
    dup[0] = dup[1]
    with pytest.raises(ValueError, match="twice"):
        causal_conv1d_update(x, weight, bias, pool, dup, advance_window=True)


def test_update_split_outputs_and_parked_inputs():
    """outs receive y's channels in order (x a strided column slice), inputs_out receives x, and
    bad outs / inputs_out raise ValueError naming them."""
    D, K, S, b, q = 24, 4, 9, 5, 3
    weight, bias = _params(D, K, torch.float32)
    pool = _pool(S, D, K, torch.float32)
    slots = _slots(S, b, pad_rows=(1,))
    x = torch.randn(b, q, D + 6)[:, :, 2:2 + D]
    want = causal_conv1d_update(x.contiguous(), weight, bias, pool, slots)
    outs = tuple(torch.full((b, q, n), float("nan")) for n in (12, 8, 4))
    park = torch.full((b, q, D), float("nan"))
    got = causal_conv1d_update(x, weight, bias, pool, slots, outs=outs, inputs_out=park)
    assert all(g is o for g, o in zip(got, outs))
    assert torch.equal(torch.cat(got, dim=2), want) and torch.equal(park, x)
    for kw, match in ((dict(outs=(torch.zeros(b, q, 12), torch.zeros(b, q, 8))), "add up"),
                      (dict(outs=(torch.zeros(b, q, 24, 2)[..., 0],)), "contiguous"),
                      (dict(outs=(torch.zeros(b, q, 24, dtype=torch.bfloat16),)), "outs"),
                      (dict(outs=()), "outs"),
                      (dict(inputs_out=torch.zeros(b, q, D - 1)), "inputs_out"),
                      (dict(inputs_out=torch.zeros(b, q, D, 2)[..., 0]), "inputs_out")):
        with pytest.raises(ValueError, match=match):
            causal_conv1d_update(x, weight, bias, pool, slots, **kw)


@requires_cuda
def test_cuda_matches_cpu_ref():
    """On CUDA the public ops (Triton when present) match the CPU references."""
    D, K, S = 64, 4, 9
    weight, bias = _params(D, K, torch.float32)
    pool = _pool(S, D, K, torch.float32)
    cu = _cu([7, 1, 20])
    slots = torch.tensor([8, -1, 2], dtype=torch.int32)
    init = torch.tensor([True, True, False])
    x = torch.randn(28, D)
    cpu_pool, gpu_pool = pool.clone(), pool.cuda()
    y_ref = causal_conv1d_varlen_ref(x, weight, bias, cpu_pool, cu, slots, init)
    y = causal_conv1d_varlen(
        x.cuda(), weight.cuda(), bias.cuda(), gpu_pool, cu.cuda(), slots.cuda(), init.cuda()
    )
    torch.testing.assert_close(y.cpu(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gpu_pool.cpu(), cpu_pool, atol=0, rtol=0)
    xq = torch.randn(3, 4, D)
    y_ref = causal_conv1d_update_ref(xq, weight, bias, cpu_pool, slots)
    y = causal_conv1d_update(xq.cuda(), weight.cuda(), bias.cuda(), gpu_pool, slots.cuda())
    torch.testing.assert_close(y.cpu(), y_ref, atol=1e-5, rtol=1e-5)
    a = torch.tensor([2, 1, 4], dtype=torch.int32)
    causal_conv1d_commit_ref(cpu_pool, xq, a, slots)
    causal_conv1d_commit(gpu_pool, xq.cuda(), a.cuda(), slots.cuda())
    torch.testing.assert_close(gpu_pool.cpu(), cpu_pool, atol=0, rtol=0)
