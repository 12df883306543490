"""Chunked SSD prefill scan vs the float64 per-token oracle, decode, and itself across chunkings."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import requires_cuda
from hypothesis import given, settings
from hypothesis import strategies as st
from ssm_oracle import softplus_dt, ssm_recurrence

from replayssm.ops.rounding import seed_tensor
from replayssm.ops.ssd import ssd_chunked_scan, ssd_chunked_scan_ref
from replayssm.ops.ssu import selective_state_update_ref

STATE_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
ACT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@dataclass
class Problem:
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor
    cu: torch.Tensor

    def args(self):
        return self.x, self.dt, self.A, self.B, self.C, self.D, self.dt_bias

    def seq(self, i: int) -> slice:
        return slice(self.cu[i].item(), self.cu[i + 1].item())

    def oracle(self, i: int, state0: torch.Tensor):
        s = self.seq(i)
        delta = softplus_dt(self.dt[s], self.dt_bias)
        return ssm_recurrence(state0, self.x[s], delta, self.A, self.B[s], self.C[s], self.D)


def _problem(lengths, H, G, P, N, dtype=torch.float32) -> Problem:
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    return Problem(
        x=torch.randn(T, H, P).to(dtype),
        dt=(torch.randn(T, H) - 1.0).to(dtype),
        A=-torch.empty(H).uniform_(0.5, 4.0),
        B=(torch.randn(T, G, N) / N**0.5).to(dtype),
        C=torch.randn(T, G, N).to(dtype),
        D=torch.randn(H),
        dt_bias=torch.randn(H) * 0.5,
        cu=cu,
    )


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()


@pytest.mark.parametrize(
    "H, G, P, N, act, state_dtype, chunk",
    [
        (4, 4, 32, 16, torch.float32, torch.float32, 16),
        (8, 1, 64, 64, torch.bfloat16, torch.bfloat16, 32),
        (16, 1, 32, 128, torch.float32, torch.float16, 8),
        (16, 2, 64, 16, torch.bfloat16, torch.float32, 64),
    ],
)
def test_matches_oracle_with_pool_padding_and_boundaries(H, G, P, N, act, state_dtype, chunk):
    """Outputs, final states and boundary states match the oracle; padding and other slots are untouched."""
    lengths = [9, 1, 40, 0, 23, 16, 5]
    n, S = len(lengths), len(lengths) + 5
    p = _problem(lengths, H, G, P, N, act)
    slots = torch.randperm(S)[:n].to(torch.int32)
    slots[5] = -1
    has_init = torch.tensor([True, False, True, True, False, True, True])
    pool = torch.randn(S, H, P, N).to(state_dtype)
    for i in range(n):  # a slot that starts from zeros must not be read
        if slots[i] >= 0 and not has_init[i]:
            pool[slots[i]] = float("nan")
    before = pool.clone()
    bseq = torch.tensor([2, 2, 2, 0, 4, 3, 5, 1], dtype=torch.int32)
    blen = torch.tensor([0, 17, 40, 9, 8, 0, 3, 1], dtype=torch.int32)
    y, bstates = ssd_chunked_scan(
        *p.args(),
        pool,
        p.cu,
        slots,
        has_init,
        chunk_size=chunk,
        rand_seed=seed_tensor(3),
        boundary_seq=bseq,
        boundary_len=blen,
    )
    assert y.dtype == act and y.shape == p.x.shape
    assert bstates.dtype == torch.float32 and bstates.shape == (len(bseq), H, P, N)
    for i in range(n):
        s = slots[i].item()
        if s < 0:
            assert bool((y[p.seq(i)] == 0).all())
            continue
        s0 = before[s].double() if has_init[i] else torch.zeros(H, P, N, dtype=torch.float64)
        y_ref, final, states = p.oracle(i, s0)
        if lengths[i]:
            assert _rel_err(y[p.seq(i)], y_ref) < ACT_RTOL[act], i
        assert _rel_err(pool[s], final) < STATE_RTOL[state_dtype], i
        for j in (bseq == i).nonzero().flatten().tolist():
            want = s0 if blen[j] == 0 else states[blen[j] - 1]
            assert _rel_err(bstates[j], want) < 1e-5, (i, j)
    written = {slots[i].item() for i in range(n) if slots[i] >= 0}
    for s in set(range(S)) - written:
        assert torch.equal(pool[s], before[s])
    for j in (bseq == 5).nonzero().flatten().tolist():  # a padding sequence starts from zeros
        assert bool(torch.isfinite(bstates[j]).all())


def test_chunk_size_does_not_change_results():
    """Chunk sizes that do and do not divide the lengths (1, 3, 16, 64) give the same outputs and states."""
    lengths = [31, 16, 7]
    H, G, P, N = 4, 2, 32, 16
    p = _problem(lengths, H, G, P, N)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    init = torch.ones(3, dtype=torch.bool)
    pool0 = torch.randn(3, H, P, N)
    results = []
    for chunk in (1, 3, 16, 64):
        pool = pool0.clone()
        y, _ = ssd_chunked_scan(*p.args(), pool, p.cu, slots, init, chunk_size=chunk)
        results.append((y, pool))
    for y, pool in results[1:]:
        torch.testing.assert_close(y, results[0][0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(pool, results[0][1], atol=2e-5, rtol=1e-5)


@settings(deadline=None, max_examples=10)
@given(
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    chunk=st.sampled_from([1, 2, 5, 8, 16]),
    seed=st.integers(0, 2**16),
)
def test_random_lengths_and_chunks_match_oracle(lengths, chunk, seed):
    """Random lengths (some empty) and chunk sizes: outputs, final and boundary states match the oracle."""
    torch.manual_seed(seed)
    H, G, P, N = 4, 2, 8, 16
    n = len(lengths)
    p = _problem(lengths, H, G, P, N)
    slots = torch.randperm(n + 2)[:n].to(torch.int32)
    has_init = torch.rand(n) < 0.5
    pool = torch.randn(n + 2, H, P, N)
    before = pool.clone()
    bseq = torch.arange(n, dtype=torch.int32)
    blen = torch.tensor([torch.randint(0, k + 1, ()).item() for k in lengths], dtype=torch.int32)
    y, bst = ssd_chunked_scan(
        *p.args(), pool, p.cu, slots, has_init, chunk_size=chunk, boundary_seq=bseq, boundary_len=blen
    )
    for i in range(n):
        s0 = before[slots[i]].double() if has_init[i] else torch.zeros(H, P, N, dtype=torch.float64)
        y_ref, final, states = p.oracle(i, s0)
        if lengths[i]:
            assert _rel_err(y[p.seq(i)], y_ref) < 1e-5
        assert _rel_err(pool[slots[i]], final) < 1e-5
        want = s0 if blen[i] == 0 else states[blen[i] - 1]
        assert _rel_err(bst[i], want) < 1e-5


def test_sequences_do_not_leak():
    """Changing one sequence's tokens leaves every other sequence's outputs and states bit-exact."""
    lengths = [12, 20, 9]
    H, G, P, N = 4, 1, 32, 16
    p = _problem(lengths, H, G, P, N)
    slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    init = torch.tensor([True, True, False])
    pool0 = torch.randn(5, H, P, N)
    pool_a, pool_b = pool0.clone(), pool0.clone()
    y_a, _ = ssd_chunked_scan(*p.args(), pool_a, p.cu, slots, init, chunk_size=8)
    mid = p.seq(1)
    p.x[mid] = torch.randn_like(p.x[mid]) * 5
    p.dt[mid] += 2.0
    p.B[mid] = torch.randn_like(p.B[mid])
    y_b, _ = ssd_chunked_scan(*p.args(), pool_b, p.cu, slots, init, chunk_size=8)
    for i in (0, 2):
        assert torch.equal(y_a[p.seq(i)], y_b[p.seq(i)])
        assert torch.equal(pool_a[slots[i]], pool_b[slots[i]])
    assert not torch.equal(pool_a[1], pool_b[1])


def test_two_calls_equal_one_call():
    """A sequence split over two calls (the second from the written state) equals one call."""
    H, G, P, N = 8, 2, 32, 64
    p = _problem([37], H, G, P, N)
    slot = torch.tensor([3], dtype=torch.int32)
    pool_one = torch.randn(6, H, P, N)
    pool_two = pool_one.clone()
    y_one, _ = ssd_chunked_scan(*p.args(), pool_one, p.cu, slot, torch.tensor([True]), chunk_size=16)
    ys = []
    for lo, hi in ((0, 21), (21, 37)):
        part = [t[lo:hi] for t in (p.x, p.dt)] + [p.A] + [t[lo:hi] for t in (p.B, p.C)] + [p.D, p.dt_bias]
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        ys.append(ssd_chunked_scan(*part, pool_two, cu, slot, torch.tensor([True]), chunk_size=16)[0])
    torch.testing.assert_close(torch.cat(ys), y_one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_two, pool_one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act, chunk", [(torch.float32, 4), (torch.bfloat16, 64)])
def test_scan_equals_repeated_decode(act, chunk):
    """The scan equals token-by-token selective_state_update_ref (fp32 pool) from the same initial states."""
    lengths = [6, 11]
    H, G, P, N = 8, 1, 32, 16
    p = _problem(lengths, H, G, P, N, act)
    slots = torch.tensor([1, 4], dtype=torch.int32)
    pool_scan = torch.randn(5, H, P, N)
    pool_dec = pool_scan.clone()
    y_scan, _ = ssd_chunked_scan(
        *p.args(), pool_scan, p.cu, slots, torch.ones(2, dtype=torch.bool), chunk_size=chunk
    )
    tol = ACT_RTOL[act]
    for i in range(2):
        s = p.seq(i)
        for t in range(s.start, s.stop):
            x, dt, B, C = (v[t][None, None] for v in (p.x, p.dt, p.B, p.C))
            y = selective_state_update_ref(pool_dec, x, dt, p.A, B, C, p.D, p.dt_bias, slots[i : i + 1])
            torch.testing.assert_close(y[0, 0].float(), y_scan[t].float(), atol=tol * 10, rtol=tol)
    torch.testing.assert_close(pool_dec, pool_scan, atol=1e-5, rtol=1e-5)


def test_low_precision_writes_are_seeded():
    """bf16 state writes are deterministic for one seed and differ for another (stochastic rounding)."""
    H, G, P, N = 4, 1, 32, 16
    p = _problem([20], H, G, P, N)
    slot = torch.tensor([1], dtype=torch.int32)
    pool0 = torch.randn(2, H, P, N).to(torch.bfloat16)
    outs = []
    for seed in (5, 5, 6):
        pool = pool0.clone()
        ssd_chunked_scan(*p.args(), pool, p.cu, slot, torch.tensor([True]), rand_seed=seed_tensor(seed))
        outs.append(pool.view(torch.int16))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_no_softplus_and_empty_batch():
    """dt_softplus=False uses dt + dt_bias as Δ; a call with no tokens writes the initial states."""
    H, G, P, N = 4, 2, 32, 16
    p = _problem([10], H, G, P, N)
    p.dt = p.dt.abs() + 0.6  # Δ = dt + dt_bias must stay positive
    pool = torch.randn(2, H, P, N)
    s0 = pool[0].clone()
    y, _ = ssd_chunked_scan(*p.args(), pool, p.cu, torch.tensor([0], dtype=torch.int32), torch.tensor([True]),
                            dt_softplus=False)  # fmt: skip
    y_ref, final, _ = ssm_recurrence(s0, p.x, p.dt.double() + p.dt_bias.double(), p.A, p.B, p.C, p.D)
    assert _rel_err(y, y_ref) < 1e-5 and _rel_err(pool[0], final) < 1e-5
    e = _problem([0, 0], H, G, P, N)
    y, b = ssd_chunked_scan(
        *e.args(), pool, e.cu, torch.tensor([1, 0], dtype=torch.int32), torch.tensor([False, True]),
        boundary_seq=torch.tensor([1], dtype=torch.int32), boundary_len=torch.tensor([0], dtype=torch.int32),
    )  # fmt: skip
    assert y.shape == (0, H, P) and bool((pool[1] == 0).all()) and torch.equal(b[0], pool[0])


def _good_args():
    H, G, P, N = 4, 2, 8, 16
    p = _problem([3, 5], H, G, P, N)
    return dict(
        x=p.x, dt=p.dt, A=p.A, B=p.B, C=p.C, D=p.D, dt_bias=p.dt_bias, state=torch.randn(4, H, P, N),
        cu_seqlens=p.cu, state_indices=torch.tensor([0, 3], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False]),
    )  # fmt: skip


@pytest.mark.parametrize(
    "name, bad",
    [
        ("dt", torch.randn(8, 3)),
        ("B", torch.randn(8, 3, 16)),
        ("C", torch.randn(8, 2, 15)),
        ("A", torch.randn(4).double()),
        ("state", torch.randn(4, 4, 8, 15)),
        ("cu_seqlens", torch.tensor([0, 3, 9], dtype=torch.int32)),
        ("state_indices", torch.tensor([0, 4], dtype=torch.int32)),
        ("state_indices", torch.tensor([1, 1], dtype=torch.int32)),
        ("has_initial_state", torch.tensor([True])),
        ("chunk_size", 0),
        ("rand_seed", -1),
        ("boundary_seq", torch.tensor([2], dtype=torch.int32)),
        ("boundary_len", torch.tensor([4], dtype=torch.int32)),
        ("boundary_dst", torch.tensor([3], dtype=torch.int32)),  # a slot of state_indices
        ("boundary_dst", torch.tensor([1, 2], dtype=torch.int32)),
        ("boundary_dst", torch.tensor([1], dtype=torch.int64)),
        ("boundary_dst", torch.tensor([4], dtype=torch.int32)),
    ],
)
def test_bad_arguments_raise(name, bad):
    """Bad arguments raise ValueError naming the argument."""
    args = _good_args()
    args["boundary_seq"] = torch.tensor([0], dtype=torch.int32)
    args["boundary_len"] = torch.tensor([2], dtype=torch.int32)
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        ssd_chunked_scan(**args)


def test_boundary_dst_needs_boundaries():
    """boundary_dst without boundary_seq / boundary_len raises ValueError naming it."""
    with pytest.raises(ValueError, match="boundary_dst"):
        ssd_chunked_scan(**_good_args(), boundary_dst=torch.tensor([1], dtype=torch.int32))


@requires_cuda
def test_cuda_matches_cpu_ref():
    """On CUDA the public scan matches the CPU reference (outputs, states, boundaries)."""
    H, G, P, N = 16, 2, 64, 128
    p = _problem([100, 1, 64, 37], H, G, P, N, torch.bfloat16)
    slots = torch.tensor([9, -1, 0, 4], dtype=torch.int32)
    init = torch.tensor([True, True, False, True])
    pool = torch.randn(10, H, P, N)
    cpu_pool, gpu_pool = pool.clone(), pool.cuda()
    bseq, blen = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([64, 5, 37], dtype=torch.int32)
    y_ref, b_ref = ssd_chunked_scan_ref(
        *p.args(), cpu_pool, p.cu, slots, init, boundary_seq=bseq, boundary_len=blen
    )
    cuda_args = [t.cuda() for t in p.args()]
    y, b = ssd_chunked_scan(
        *cuda_args,
        gpu_pool,
        p.cu.cuda(),
        slots.cuda(),
        init.cuda(),
        boundary_seq=bseq.cuda(),
        boundary_len=blen.cuda(),
    )
    torch.testing.assert_close(y.cpu().float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gpu_pool.cpu(), cpu_pool, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(b.cpu(), b_ref, atol=1e-3, rtol=1e-3)
