"""Triton-vs-reference checks shared by the GPU tests and the interpreter run.

Each `check_*` builds random inputs (never zeros) on `device`, runs the Triton twin on a
copy with a NaN-poisoned output and the `*_ref` on another copy, and asserts: outputs close,
written state close, every untouched slot bit-exact, and a second Triton run bit-identical
(no races). Run as a script under TRITON_INTERPRET=1 it checks tiny CPU shapes.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from replayssm.ops.conv1d import causal_conv1d_commit_ref, causal_conv1d_update_ref, causal_conv1d_varlen_ref
from replayssm.ops.replay import replay_commit_ref, replay_forward_ref, replay_materialize_ref
from replayssm.ops.rounding import seed_tensor, stochastic_round_ref
from replayssm.ops.ssu import selective_state_update_ref
from replayssm.ops.triton.rounding import load_seed_mix, max_finite, stochastic_round, tl_dtype

TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any(), f"{name}: NaN (unwritten output)"
    tol = TOL[dtype]
    err = (got.double() - want.double()).abs()
    bound = tol * (1.0 + want.double().abs())
    assert bool((err <= bound).all()), f"{name}: max err {err.max().item():.3e} (tol {tol})"


def _slots(b: int, S: int, device, pad: int = 1) -> torch.Tensor:
    """b distinct permuted slots from a pool of S, with `pad` padding rows (-1) at random places."""
    idx = torch.randperm(S)[:b].to(torch.int32)
    idx[torch.randperm(b)[:pad]] = -1
    return idx.to(device)


def _params(H: int, device):
    A = -torch.exp(torch.rand(H) * 1.5 - 1.0)
    D = torch.randn(H)
    dt_bias = torch.randn(H) * 0.5
    return A.to(device), D.to(device), dt_bias.to(device)


def _tokens(b, q, H, P, G, N, act, device):
    x = torch.randn(b, q, H, P).to(act).to(device)
    dt = torch.randn(b, q, H).to(device)
    B = torch.randn(b, q, G, N).to(act).to(device)
    C = torch.randn(b, q, G, N).to(act).to(device)
    return x, dt, B, C


def _untouched(name, got, orig, touched: torch.Tensor) -> None:
    keep = torch.ones(orig.shape[0], dtype=torch.bool, device=orig.device)
    keep[touched[touched >= 0].long()] = False
    assert torch.equal(got[keep], orig[keep]), f"{name}: an untouched slot changed"


@triton.jit
def _round_kernel(x_ptr, off_ptr, y_ptr, n, seed_ptr, DTYPE: tl.constexpr, MAXV: tl.constexpr,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    sm = load_seed_mix(seed_ptr, DTYPE)
    y = stochastic_round(tl.load(x_ptr + i, mask=m), tl.load(off_ptr + i, mask=m), sm, DTYPE, MAXV)
    tl.store(y_ptr + i, y, mask=m)


def check_rounding(device, n: int = 4099, seed: int = 1234) -> None:
    """The Triton device function, its seed read from device memory, rounds bit-identically to
    stochastic_round_ref with the same seed value (edge values and seeds past 2^32 too)."""
    torch.manual_seed(seed)
    x = torch.randn(n) * torch.logspace(-12, 7, n)
    inf = float("inf")
    edge = [0.0, -0.0, inf, -inf, 65504.0, 65519.0, 7e4, -7e4, 1e-30, -1e-30, 3.4e38, -3.4e38]
    x = torch.cat([x, torch.tensor(edge)]).to(device)
    off = (torch.randperm(x.numel()).to(torch.int64) * 7919 + 2**33).to(device)
    for dtype in (torch.float16, torch.bfloat16):
        y = torch.empty(x.shape, dtype=dtype, device=device)
        tdt = tl_dtype(dtype)
        grid = (triton.cdiv(x.numel(), 512),)
        for value in (seed, -seed, 2**40 + seed):
            seed_ptr = seed_tensor(value, device)
            _round_kernel[grid](x, off, y, x.numel(), seed_ptr, tdt, max_finite(tdt), BLOCK=512)
            want = stochastic_round_ref(x, dtype, value, off).view(torch.int16)
            assert torch.equal(y.view(torch.int16), want), f"{dtype} seed {value}: bits differ"


def check_ssu(device, *, H=4, P=12, N=12, G=2, b=5, q=1, S=11, state_dtype=torch.float32, act=torch.float32,
              verify=False, config=None, seed=0) -> None:
    """Baseline SSU (plain or per-draft verify) vs reference."""
    from replayssm.ops.triton import ssu

    torch.manual_seed(seed)
    state0 = (torch.randn(S, H, P, N) * 2).to(state_dtype).to(device)
    x, dt, B, C = _tokens(b, q, H, P, G, N, act, device)
    A, D, dt_bias = _params(H, device)
    idx = _slots(b, S, device)
    dst = None
    if verify:
        # Destinations distinct from every source; one skipped (-1) entry.
        free = torch.tensor([s for s in torch.randperm(S).tolist() if s not in idx.tolist()])
        dst = torch.full((b, q), -1, dtype=torch.int32)
        flat = free[: b * q - 1]
        dst.view(-1)[: flat.numel()] = flat.to(torch.int32)
        dst = dst.to(device)
    args = (x, dt, A, B, C, D, dt_bias, idx)
    cfg = config or ssu.CONFIGS[state0.dtype]
    runs = []
    for _ in range(2):
        st = state0.clone()
        y = ssu.launch_ssu(st, *args, dst, True, 7, torch.full_like(x, float("nan")), cfg)
        runs.append((y, st))
    st_ref = state0.clone()
    y_ref = selective_state_update_ref(st_ref, *args, dst_indices=dst, rand_seed=seed_tensor(7, device))
    y, st = runs[0]
    assert torch.equal(runs[1][0], y) and torch.equal(runs[1][1], st), "two runs differ"
    _close("y", y, y_ref, act)
    _close("state", st.float(), st_ref.float(), state_dtype)
    touched = idx if dst is None else dst.flatten()
    _untouched("state", st, state0, touched)


def check_ssu_rounding(device, *, state_dtype, verify=False, H=4, P=12, N=12, G=2, b=5, q=2, S=11,
                       config=None) -> None:
    """The baseline kernel's fused rounding writes the reference's bits for the same device seed.

    Inputs make the fp32 states exact in any evaluation order (A = 0, so every decay is 1; Δ, x, B
    and the states with few mantissa bits), so both twins round the same fp32 values; and a new
    seed value in the same tensor changes the bits (the kernel reads it at launch).
    """
    from replayssm.ops.triton import ssu

    torch.manual_seed(3)
    state0 = (torch.randint(-512, 512, (S, H, P, N)) / 128.0).to(state_dtype).to(device)
    x = (torch.randint(-64, 65, (b, q, H, P)) / 64.0).to(device)
    dt = (torch.randint(1, 4, (b, q, H)) / 4.0).to(device)
    B = (torch.randint(-64, 65, (b, q, G, N)) / 64.0).to(device)
    C = torch.randn(b, q, G, N).to(device)
    A, D, dt_bias = torch.zeros(H).to(device), torch.randn(H).to(device), torch.full((H,), 0.25).to(device)
    idx = _slots(b, S, device)
    dst = None
    if verify:
        free = [s for s in torch.randperm(S).tolist() if s not in idx.tolist()][: b * q]
        dst = torch.tensor(free + [-1] * (b * q - len(free)), dtype=torch.int32).view(b, q).to(device)
    args = (x, dt, A, B, C, D, dt_bias, idx)
    seed = seed_tensor(41, device)
    st = state0.clone()
    ssu.launch_ssu(st, *args, dst, False, seed, None, config or ssu.CONFIGS[state0.dtype])
    st_ref = state0.clone()
    selective_state_update_ref(st_ref, *args, dst_indices=dst, dt_softplus=False, rand_seed=seed)
    assert torch.equal(st.view(torch.int16), st_ref.view(torch.int16)), "fused rounding differs from the ref"
    seed.fill_(42)
    again = state0.clone()
    ssu.launch_ssu(again, *args, dst, False, seed, None, config or ssu.CONFIGS[state0.dtype])
    assert not torch.equal(again.view(torch.int16), st.view(torch.int16)), "a new seed drew the same bits"


def _ring(S, H, G, R, P, N, act, device):
    ring_x = torch.randn(S, H, R, P).to(act).to(device)
    ring_B = torch.randn(S, G, R, N).to(act).to(device)
    ring_dt = (torch.rand(S, H, R) * 0.5 + 0.01).to(device)
    return ring_x, ring_B, ring_dt


def check_replay_cycle(device, *, H=4, P=24, N=12, G=2, b=5, q=2, S=11, W=5, steps=9,
                       state_dtype=torch.float32, act=torch.float32, route=None, seed=0,
                       lockstep=False) -> None:
    """Forward + commit over several steps (random accepts, flushes, ring wrap) vs reference, by `route`
    (a settings object of `ops.triton.replay`; None: the table's choice). lockstep: every cursor starts
    empty, so with q = 1 all rows flush on the same steps."""
    from replayssm.ops.triton import replay

    torch.manual_seed(seed)
    R = W + q + 1
    A, D, dt_bias = _params(H, device)
    state = (torch.randn(S, H, P, N) * 2).to(state_dtype).to(device)
    rings = _ring(S, H, G, R, P, N, act, device)
    start = torch.randint(0, R, (S,), dtype=torch.int32).to(device)
    comm = torch.randint(0, W + 1, (S,), dtype=torch.int32).to(device)
    if lockstep:
        comm.zero_()
    tri = [state.clone(), *[r.clone() for r in rings], start.clone(), comm.clone()]
    ref = [state.clone(), *[r.clone() for r in rings], start.clone(), comm.clone()]
    idx = _slots(b, S, device)
    for step in range(steps):
        x, dt, B, C = _tokens(b, q, H, P, G, N, act, device)
        # Every accept count 1..q appears on every step (rows rotate through them).
        acc = ((torch.arange(b) + step) % q + 1).to(torch.int32).to(device)
        before = [t.clone() for t in tri]
        outs = []
        for _ in range(2):
            cur = [t.clone() for t in before]
            y = replay.launch_replay_forward(x, dt, A, B, C, D, dt_bias, *cur[:6], idx, W, True, step,
                                             torch.full_like(x, float("nan")), route)
            outs.append((y, cur))
        y, tri = outs[0]
        assert torch.equal(outs[1][0], y), "two runs differ (y)"
        assert all(torch.equal(u, v) for u, v in zip(outs[1][1], tri)), "two runs differ (cache)"
        y_ref = replay_forward_ref(x, dt, A, B, C, D, dt_bias, *ref[:6], idx, W,
                                   rand_seed=seed_tensor(step, device))
        _close(f"y step {step}", y, y_ref, act)
        _close(f"state step {step}", tri[0].float(), ref[0].float(), state_dtype)
        _untouched("state", tri[0], before[0], idx)
        assert torch.equal(tri[1], ref[1]) and torch.equal(tri[2], ref[2]), "ring x/B differ"
        _close("ring_dt", tri[3], ref[3], torch.float32)
        _untouched("ring_dt", tri[3], before[3], idx)
        # Non-flushed slots keep their state bit-exact.
        valid = idx >= 0
        slots = idx[valid].long()
        keep = before[5][slots] + q <= W
        assert torch.equal(tri[0][slots[keep]], before[0][slots[keep]]), "non-flush row wrote its state"
        replay.replay_commit_triton(tri[4], tri[5], idx, acc, q, W, ring_rows=R)
        replay_commit_ref(ref[4], ref[5], idx, acc, q, W, ring_rows=R)
        assert torch.equal(tri[4], ref[4]) and torch.equal(tri[5], ref[5]), "cursors differ"
        # Keep the two caches on the same inputs: the reference's rounding is the oracle here.
        tri = [r.clone() for r in ref]


def check_output_passes(device, route, *, H=8, P=64, N=128, G=2, b=12, q=4, S=40, W=16) -> None:
    """Cheaper output products where y is bf16 (one TF32 pass, `tf32.dot_out`; bf16 hi + lo,
    `tf32.dot_bf16_split`): the largest error against the fp32 reference (run on the CPU) stays
    within a bf16 ulp at the step's output scale, 2^-7 max |y|. (The cycle tests allow 3e-2 (1 + |y|);
    the interpreter's bf16 stores truncate, which this bound also admits.)"""
    from replayssm.ops.triton import replay

    torch.manual_seed(5)
    R = W + q + 1
    A, D, dt_bias = _params(H, device)
    state = (torch.randn(S, H, P, N) * 2).to(device)
    cache = [state, *_ring(S, H, G, R, P, N, torch.bfloat16, device),
             torch.randint(0, R, (S,), dtype=torch.int32).to(device),
             torch.randint(0, W + 1, (S,), dtype=torch.int32).to(device)]
    idx = _slots(b, S, device)
    x, dt, B, C = _tokens(b, q, H, P, G, N, torch.bfloat16, device)
    args = (x, dt, A, B, C, D, dt_bias)
    cpu = [t.to("cpu", copy=True) for t in (*args, *cache, idx)]  # the reference appends and folds in place
    y_ref = replay_forward_ref(*cpu, W, rand_seed=seed_tensor(1), out=torch.empty(x.shape)).double()
    bound = 2.0**-7 * y_ref.abs().max().item()
    y = replay.launch_replay_forward(*args, *[t.clone() for t in cache], idx, W, True, 1,
                                     torch.full_like(x, float("nan")), route)
    err = (y.cpu().double() - y_ref).abs().max().item()
    assert err <= bound, f"{route}: max error {err:.3e} > 2^-7 max|y| = {bound:.3e}"


def check_graph_replay(route, q: int, *, H=8, P=64, N=128, G=2, b=24, S=40, W=16, starts=6) -> None:
    """One forward step captured in a CUDA graph gives the eager step's bits (outputs and the whole
    cache), from several cursor states: a route that forks a side stream must have its fork and
    join captured as graph edges (a missed one shows as a race against the eager result)."""
    from replayssm.ops.triton import replay

    torch.manual_seed(7)
    R = W + q + 1
    A, D, dt_bias = _params(H, "cuda")
    cache = [(torch.randn(S, H, P, N) * 2).cuda(), *_ring(S, H, G, R, P, N, torch.bfloat16, "cuda"),
             torch.randint(0, R, (S,), dtype=torch.int32).cuda(),
             torch.randint(0, W + 1, (S,), dtype=torch.int32).cuda()]
    idx = _slots(b, S, "cuda")
    args = _tokens(b, q, H, P, G, N, torch.bfloat16, "cuda")
    x, dt, B, C = args
    static = [t.clone() for t in cache]
    y = torch.empty_like(x)

    def step(cur, out):
        replay.launch_replay_forward(x, dt, A, B, C, D, dt_bias, *cur, idx, W, True, 3, out, route)

    step(static, y)  # compiles every kernel (and creates the side stream) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static, y)
    for k in range(starts):
        start = [t.clone() for t in cache]
        start[5] = (start[5] + 3 * k) % (W + 1)  # other rows flush at each start
        eager = [t.clone() for t in start]
        y_eager = torch.full_like(x, float("nan"))
        step(eager, y_eager)
        for dst, src in zip(static, start):
            dst.copy_(src)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y_eager), f"start {k}: graph outputs differ from eager"
        assert all(torch.equal(u, v) for u, v in zip(static, eager)), f"start {k}: graph cache differs"


def check_materialize(device, *, H=4, P=12, N=12, G=2, m=4, S=13, W=5, state_dtype=torch.float32,
                      act=torch.float32, seed=0) -> None:
    """Materialize (state of src advanced by n ring entries into dst) vs reference."""
    from replayssm.ops.triton import replay

    torch.manual_seed(seed)
    R = W + 3
    A, _, _ = _params(H, device)
    state = (torch.randn(S, H, P, N) * 2).to(state_dtype).to(device)
    rings = _ring(S, H, G, R, P, N, act, device)
    start = torch.randint(0, R, (S,), dtype=torch.int32).to(device)
    comm = torch.randint(0, W + 1, (S,), dtype=torch.int32).to(device)
    perm = torch.randperm(S)
    src = perm[:m].to(torch.int32)
    dst = perm[m : 2 * m].to(torch.int32)
    dst[0] = -1
    n = (torch.rand(m) * (comm[src.long()].cpu().float() + 1)).floor().to(torch.int32)
    n[1] = 0
    src, dst, n = src.to(device), dst.to(device), n.to(device)
    args = (A, state, *rings, start, comm, src, n, dst)
    got = []
    for _ in range(2):
        st = state.clone()
        replay.replay_materialize_triton(A, st, *args[2:], rand_seed=seed_tensor(3, device))
        got.append(st)
    assert torch.equal(got[0], got[1]), "two runs differ"
    st_ref = state.clone()
    replay_materialize_ref(A, st_ref, *args[2:], rand_seed=seed_tensor(3, device))
    _close("state", got[0].float(), st_ref.float(), state_dtype)
    _untouched("state", got[0], state, dst)
    zero = (n == 0) & (dst >= 0)
    assert torch.equal(got[0][dst[zero].long()], state[src[zero].long()]), "n = 0 is not an exact copy"


def check_conv(device, *, Dc=40, K=4, b=5, q=3, S=9, act=torch.float32, bias=True, seed=0) -> None:
    """Conv update (window unchanged) and commit (every a in 0..q, src == dst and moved) vs reference."""
    from replayssm.ops.triton import conv1d

    torch.manual_seed(seed)
    cs = torch.randn(S, Dc, K - 1).to(act).to(device)
    x = torch.randn(b, q, Dc).to(act).to(device)
    w = torch.randn(Dc, K).to(device)
    bb = torch.randn(Dc).to(device) if bias else None
    idx = _slots(b, S, device)
    for activation in ("silu", None):
        c1 = cs.clone()
        y = conv1d.causal_conv1d_update_triton(x, w, bb, c1, idx, activation)
        _close("conv y", y, causal_conv1d_update_ref(x, w, bb, cs, idx, activation), act)
        assert torch.equal(c1, cs), "update changed the window"
    # x a column slice of a wider projection (strided rows), outputs split in three (boundaries inside
    # a channel block), raw inputs parked in a strided view of a larger scratch; outputs NaN first.
    xs = torch.randn(b, q, Dc + 24).to(act).to(device)[:, :, 8:8 + Dc]
    widths = (Dc // 2, Dc // 4, Dc - Dc // 2 - Dc // 4)
    outs = [torch.full((b, q, n), float("nan"), dtype=act, device=device) for n in widths]
    park = torch.full((b + 2, q + 1, Dc), float("nan"), dtype=act, device=device)
    got = conv1d.causal_conv1d_update_triton(xs, w, bb, cs, idx, "silu", outs=outs, inputs_out=park[:b, :q])
    assert all(g is o for g, o in zip(got, outs))
    _close("conv split", torch.cat(got, dim=2), causal_conv1d_update_ref(xs, w, bb, cs, idx, "silu"), act)
    assert torch.equal(park[:b, :q], xs), "parked inputs differ"
    assert park[b:].isnan().all() and park[:, q:].isnan().all(), "parked past the view"
    # advance_window (per channel, and as contiguous runs): the same outputs, and the windows an a = q
    # commit writes (others untouched).
    c2 = cs.clone()
    causal_conv1d_commit_ref(c2, xs, torch.full((b,), q, dtype=torch.int32, device=device), idx)
    for flat in (False, True):
        c1 = cs.clone()
        got = conv1d.causal_conv1d_update_triton(xs, w, bb, c1, idx, "silu", advance_window=True,
                                                 flat_window=flat)
        want = causal_conv1d_update_ref(xs, w, bb, cs, idx, "silu")
        _close(f"conv advance y (flat {flat})", got, want, act)
        assert torch.equal(c1, c2), f"advanced windows (flat {flat}) differ from an a = q commit"
        assert not torch.equal(c1, cs), "nothing advanced"
    for moved in (False, True):
        acc = (torch.arange(b) % (q + 1)).to(torch.int32).to(device)
        dst = None
        if moved:
            free = [s for s in torch.randperm(S).tolist() if s not in idx.tolist()]
            dst = torch.tensor(free[:b], dtype=torch.int32).to(device)
        c1, c2 = cs.clone(), cs.clone()
        conv1d.causal_conv1d_commit_triton(c1, x, acc, idx, dst)
        causal_conv1d_commit_ref(c2, x, acc, idx, dst)
        assert torch.equal(c1, c2), "commit differs from reference"


def check_conv_advance(device, *, Dc=10240, K=4, b=256, q=1, S=300, steps=4, act=torch.bfloat16,
                       flat=None, seed=0) -> None:
    """Decode steps at the engine's size with advance_window (every program writes its windows after
    its reads, many warps in flight): each step's windows equal an a = q commit's, outputs the
    reference's, the other slots untouched."""
    from replayssm.ops.triton import conv1d

    torch.manual_seed(seed)
    c1 = torch.randn(S, Dc, K - 1).to(act).to(device)
    c2 = c1.clone()
    w = torch.randn(Dc, K).to(device)
    bb = torch.randn(Dc).to(device)
    idx = _slots(b, S, device)
    full = torch.full((b,), q, dtype=torch.int32, device=device)
    for step in range(steps):
        x = torch.randn(b, q, Dc + 64).to(act).to(device)[:, :, 32:32 + Dc]  # strided rows, as in the engine
        y = conv1d.causal_conv1d_update_triton(x, w, bb, c1, idx, "silu", advance_window=True,
                                               flat_window=flat)
        _close(f"conv advance y, step {step}", y, causal_conv1d_update_ref(x, w, bb, c2, idx, "silu"), act)
        causal_conv1d_commit_ref(c2, x, full, idx)
        assert torch.equal(c1, c2), f"advanced windows differ at step {step}"


def check_conv_varlen(device, *, Dc=40, K=4, lengths=(0, 1, 2, 13, 5, 0, 3, 30, 1), S=13, act=torch.float32,
                      state_dtype=None, bias=True, strided=False, blocks=None, seed=0) -> None:
    """Varlen prefill conv vs reference: outputs (NaN-poisoned buffer), windows bit-exact, others untouched.

    Sequences of the given lengths (0, shorter than K-1, across token blocks) in permuted slots of a
    larger pool, two of them padding (-1, one non-empty), has_initial_state mixed.
    """
    from replayssm.ops.triton import conv1d

    torch.manual_seed(seed)
    n = len(lengths)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(device)
    idx = torch.randperm(S)[:n].to(torch.int32)
    idx[[n - 2, 1 if n > 2 else 0]] = -1  # the next-to-last sequence (30 tokens by default) and a short one
    idx = idx.to(device)
    init = (torch.arange(n) % 3 != 1).to(device)
    cs = torch.randn(S, Dc, K - 1).to(state_dtype or act).to(device)
    # strided: x is a column slice of a wider buffer (rows strided by Dc + 24), as a split view is.
    wide = torch.randn(T, Dc + 24).to(act).to(device)
    x = wide[:, 8 : 8 + Dc] if strided else wide[:, :Dc].contiguous()
    w = torch.randn(Dc, 1, K).to(act).to(device)[:, 0, :]
    bb = torch.randn(Dc).to(act).to(device) if bias else None
    kw = dict(block_t=blocks[0], block_d=blocks[1]) if blocks else {}
    for activation in ("silu", None):
        runs = []
        for _ in range(2):
            c1 = cs.clone()
            y = torch.full((T, Dc), float("nan"), dtype=act, device=device)
            conv1d.causal_conv1d_varlen_triton(x, w, bb, c1, cu, idx, init, activation, out=y, **kw)
            runs.append((y, c1))
        y, c1 = runs[0]
        assert torch.equal(runs[1][0], y) and torch.equal(runs[1][1], c1), "two runs differ"
        c2 = cs.clone()
        y_ref = causal_conv1d_varlen_ref(x, w, bb, c2, cu, idx, init, activation)
        _close("varlen y", y, y_ref, act)
        assert torch.equal(c1, c2), f"varlen windows differ from reference (K={K})"
        _untouched("varlen windows", c1, cs, idx)
        pad = torch.repeat_interleave(idx.cpu() < 0, torch.tensor(lengths)).to(device)
        assert bool((y[pad] == 0).all()), "padding sequence output is not zero"


def check_relu2(device, *, shape=(5, 2051), seed=0) -> None:
    """Triton relu² vs the reference: the same bits for every float dtype, a ragged last block and a
    transposed (non-contiguous) input; signs mixed, no zeros. (The interpreter's bf16 stores
    truncate: there the fp32 square truncated to bf16 is the exact expectation.)"""
    from replayssm.ops.activation import relu2_ref
    from replayssm.ops.triton.activation import relu2_triton

    torch.manual_seed(seed)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(shape) * 30).to(dt).to(device)
        for v in (x, x.t()):
            got = relu2_triton(v)
            want = relu2_ref(v)
            if device == "cpu" and dt == torch.bfloat16:
                sq = relu2_ref(v.float())
                want = ((sq.view(torch.int32) >> 16) << 16).view(torch.float32).to(dt)
            assert got.dtype == dt and got.shape == v.shape
            assert torch.equal(got, want), f"relu2 {dt} contiguous={v.is_contiguous()}"
    assert relu2_triton(torch.randn(0, 3).to(device)).shape == (0, 3)


def check_norm(device, *, rows=7, shapes=((96, 24), (256, 64), (40, 40)), seed=0) -> None:
    """Triton RMSNorm / gated RMSNorm vs their references: dtypes, gate on/off, masked groups, strides."""
    from replayssm.ops.norm import rms_norm_gated_ref, rms_norm_ref
    from replayssm.ops.triton.norm import rms_norm_gated_triton, rms_norm_triton

    torch.manual_seed(seed)
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    pairs = ((f32, f32), (bf16, bf16), (bf16, f32), (f16, f16))
    for xd, wd in pairs:
        for C, gs in shapes:
            x = (torch.randn(rows, C) * 2).to(xd).to(device)
            z = torch.randn(rows, C).to(xd).to(device)
            w = (1 + 0.5 * torch.randn(C)).to(wd).to(device)
            outs = [(rms_norm_gated_triton(x, g, w, 1e-5, gs), rms_norm_gated_ref(x, g, w, 1e-5, gs))
                    for g in (z, None)]
            outs += [(rms_norm_triton(x, w, 1e-6, cf), rms_norm_ref(x, w, 1e-6, cf)) for cf in (False, True)]
            for got, want in outs:
                assert got.dtype == want.dtype and got.shape == want.shape
                # fp32: summation order only; 16-bit x: the normalized value is rounded to x's dtype
                # (and the product again), so an fp32 difference in the sum may move it by up to
                # two units of that dtype.
                tol = 2e-6 if xd == torch.float32 else 2 * 2.0 ** -7
                err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)).max().item()
                assert err <= tol, f"norm {xd} {wd} C={C} gs={gs}: {err}"
    xt = torch.randn(64, 6).to(device).t()  # rows strided by 1, columns by 6
    w = torch.randn(64).to(device)
    assert torch.equal(rms_norm_triton(xt, w, 1e-5, False), rms_norm_triton(xt.contiguous(), w, 1e-5, False))
    assert rms_norm_triton(torch.randn(0, 64).to(device), w, 1e-5, False).shape == (0, 64)
    # fp32 against the float64 formula, groups of 32.
    x, z = torch.randn(5, 128).to(device), torch.randn(5, 128).to(device)
    g = (x.double() * F.silu(z.double())).view(5, 4, 32)
    want = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)).view(5, 128)
    got = rms_norm_gated_triton(x, z, torch.ones(128).to(device), 1e-6, 32)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _replay_basic() -> None:
    """The fallback route (masked tiles: any P, N), by the table's choice and forced, and materialize."""
    from replayssm.ops.triton.replay import Fallback

    small = Fallback(block_p=16, num_warps=1)  # P = 24: a full and a masked tile
    for q, route in ((1, None), (3, None), (2, small)):
        check_replay_cycle("cpu", q=q, route=route, steps=6)
    check_replay_cycle("cpu", q=2, act=torch.bfloat16, N=16, P=16, steps=5)
    check_replay_cycle("cpu", q=2, state_dtype=torch.bfloat16, act=torch.bfloat16, route=small, steps=4)
    check_replay_cycle("cpu", q=1, state_dtype=torch.float16, act=torch.bfloat16, route=small, steps=6)
    check_materialize("cpu", state_dtype=torch.float16)
    check_materialize("cpu")


def _replay_lean() -> None:
    """Route Lean (one token): bare output products beside the weights, ring-term and flush launches."""
    from replayssm.ops.triton.replay import Lean

    # Two P tiles; H = 12, G = 2 in ring-term blocks of 4 heads (the last block masked).
    check_replay_cycle("cpu", q=1, P=32, N=16, H=12, G=2, route=Lean(16, 1), steps=6)
    check_replay_cycle("cpu", q=1, P=32, N=16, W=16, route=Lean(16, 1), steps=18, state_dtype=torch.float16,
                       act=torch.bfloat16)
    # Few flush programs: while at most half the rows flush, 1 of the flush launch's 4 programs per SM
    # (the interpreter's one SM) walks every piece; the whole grid on steps where the batch flushes.
    few = Lean(16, 1, few_flush_programs_per_sm=1)
    check_replay_cycle("cpu", q=1, P=16, N=16, route=few, steps=7)
    check_replay_cycle("cpu", q=1, P=16, N=16, route=few, steps=7, lockstep=True)


def _replay_stream() -> None:
    """Route Stream (several tokens) at 16-row tiles. TF32 products only: the bf16 hi + lo products (bf16
    C and y) miss the reference under the interpreter (errors ~1e11) and are checked on the GPU."""
    from replayssm.ops.triton.replay import Stream

    fp32 = dict(flush_programs_per_sm=2, flush_parts=1, flush_maxnreg=160, stream_maxnreg=72, pdl=True,
                block_p=16, num_warps=1)
    # Eight pieces a program: 2 groups of 4 heads x 2 P tiles, each program in one group (C loaded once
    # per program); W = 5: the history padded from 8 to 16 for the weights launch's B·C products.
    check_replay_cycle("cpu", q=3, P=32, N=32, H=8, G=2, route=Stream(**fp32), steps=8)
    # 4 groups of 3 heads: a program's pieces span groups (C loaded per piece); two pieces per program.
    check_replay_cycle("cpu", q=2, P=32, N=32, H=12, G=4, route=Stream(**fp32), steps=6, act=torch.float16)
    check_replay_cycle("cpu", q=4, P=16, N=32, route=Stream(**dict(fp32, items=2)), steps=8,
                       state_dtype=torch.float16)
    # Flush pieces in two column parts, one per pipelined iteration (the state product carried between
    # parts, each part folding its own columns); fp16 state, history and ring wrap through W = 5.
    parts = Stream(flush_programs_per_sm=4, flush_parts=2, flush_maxnreg=96, stream_maxnreg=80, pdl=False,
                   block_p=16, num_warps=1)
    check_replay_cycle("cpu", q=3, P=32, N=64, route=parts, steps=8, state_dtype=torch.float16)


def _replay_mono() -> None:
    """The one-launch routes Mono and MonoMMA."""
    from replayssm.ops.triton.replay import Mono, MonoMMA

    # Mono: two P tiles (appends from tile 0 only), a masked window (W = 8), several tokens too.
    check_replay_cycle("cpu", q=1, P=16, N=64, W=8, route=Mono(16, 1), steps=10, state_dtype=torch.float16)
    check_replay_cycle("cpu", q=3, P=32, N=16, route=Mono(16, 1), steps=6, act=torch.bfloat16)
    # order: a grid of 2b rows, flush rows' programs in the first half (padding rows and rows that do not
    # flush in the second): every row worked exactly once, in both cursor mixes.
    check_replay_cycle("cpu", q=1, P=16, N=32, W=4, route=Mono(16, 1, order=True), steps=6, lockstep=True)
    check_replay_cycle("cpu", q=1, P=32, N=16, route=Mono(16, 1, order=True), steps=6)
    # MonoMMA: tokens padded to 16 product rows; fp32 and 16-bit activations and pools.
    check_replay_cycle("cpu", q=3, P=32, N=16, route=MonoMMA(16, 1), steps=6, act=torch.bfloat16)
    check_replay_cycle("cpu", q=4, P=16, N=32, W=8, route=MonoMMA(16, 1), steps=8, state_dtype=torch.float16)
    check_output_passes("cpu", MonoMMA(16, 1), H=4, P=16, N=32, b=5, q=3, S=11, W=8)
    check_replay_cycle("cpu", q=3, P=32, N=16, route=MonoMMA(16, 1, order=True), steps=6, act=torch.bfloat16)
    # join: a flush row's fold first and its outputs from the folded state, one pass over its 32 rows
    # (several column chunks); fp32 and 16-bit pools, ordered or not.
    check_replay_cycle("cpu", q=4, P=32, N=64, W=8, route=MonoMMA(32, 1, join=True), steps=8,
                       state_dtype=torch.float16)
    check_replay_cycle("cpu", q=2, P=64, N=32, route=MonoMMA(32, 1, order=True, join=True), steps=6,
                       act=torch.bfloat16)
    # split: a flush row's 64-row tile in two programs of 32 rows each (a grid of 3b rows), the first
    # appending, under a register cap (which the interpreter takes and ignores).
    split = MonoMMA(64, 1, order=True, join=True, split=2, maxnreg=128)
    check_replay_cycle("cpu", q=3, P=64, N=32, route=split, steps=6, act=torch.bfloat16)


# The replay cases in four parts, each its own interpreter process (and test), so no one test
# runs for many minutes on a 2-core CI machine.
REPLAY_PARTS = {"replay": _replay_basic, "replay-lean": _replay_lean, "replay-stream": _replay_stream,
                "replay-mono": _replay_mono}


def run_interpreter(part: str) -> None:
    """Tiny CPU shapes under TRITON_INTERPRET=1 (tiles smaller than P to exercise masks)."""
    from replayssm.ops.triton.ssu import LaunchConfig

    if part == "ssu":
        small = LaunchConfig(block_p=8, num_warps=1)
        check_rounding("cpu")
        for sd in (torch.float32, torch.float16, torch.bfloat16):
            check_ssu("cpu", q=1, state_dtype=sd, config=small)
        check_ssu("cpu", q=3, verify=True, state_dtype=torch.float16, act=torch.bfloat16, config=small)
        check_ssu("cpu", q=2, act=torch.float16, config=small)
        for sd in (torch.float16, torch.bfloat16):
            check_ssu_rounding("cpu", state_dtype=sd, config=small)
            check_ssu_rounding("cpu", state_dtype=sd, verify=True, q=3, config=small)
    elif part in REPLAY_PARTS:
        REPLAY_PARTS[part]()
    elif part == "norm":
        check_norm("cpu")
    elif part == "activation":
        check_relu2("cpu")
    elif part == "conv":
        check_conv("cpu")
        check_conv("cpu", K=2, q=1, act=torch.bfloat16, bias=False)
        # Fewer tokens than window columns (the advance shifts window columns down), and two channel
        # blocks of 256, the second cut short: the contiguous-run advance's offsets across programs.
        check_conv("cpu", Dc=300, q=1, act=torch.bfloat16)
        check_conv("cpu", Dc=300, q=2, b=3)
        # Tiles of 8 tokens x 16 channels: sequences span blocks and blocks hold several sequences.
        check_conv_varlen("cpu", blocks=(8, 16))
        check_conv_varlen("cpu", K=2, act=torch.bfloat16, bias=False, strided=True, blocks=(8, 16))
        check_conv_varlen("cpu", K=3, act=torch.bfloat16, state_dtype=torch.float32, blocks=(16, 32),
                          lengths=(4, 0, 1, 9, 2))
    elif part == "ssd":
        from ssd_cases import run_interpreter as run_ssd

        run_ssd()
    else:
        raise ValueError(f"part: unknown {part!r}")


def run_gpu_smoke() -> None:
    """A short GPU pass over every kernel (for a device run with little time); prints one line each."""
    big = dict(H=8, P=64, N=128, G=2)
    checks = {
        "replay q=1 fp32": lambda: check_replay_cycle("cuda", **big, b=12, S=40, W=16, steps=20, q=1,
                                                      act=torch.bfloat16),
        "replay q=4 fp16": lambda: check_replay_cycle("cuda", **big, b=12, S=40, W=16, steps=20, q=4,
                                                      state_dtype=torch.float16, act=torch.bfloat16),
        "replay q=2 bf16": lambda: check_replay_cycle("cuda", **big, b=12, S=40, W=16, steps=12, q=2,
                                                      state_dtype=torch.bfloat16, act=torch.bfloat16),
        "replay q=2 fp32 act": lambda: check_replay_cycle("cuda", **big, b=12, S=40, W=16, steps=12, q=2),
        "materialize fp32": lambda: check_materialize("cuda", **big, m=10, S=40, W=16, act=torch.bfloat16),
        "materialize fp16": lambda: check_materialize("cuda", **big, m=10, S=40, W=16, act=torch.bfloat16,
                                                      state_dtype=torch.float16),
        "conv K4 q4 bf16": lambda: check_conv("cuda", Dc=1000, K=4, b=12, q=4, S=40, act=torch.bfloat16),
        "conv K2 q3 fp32": lambda: check_conv("cuda", Dc=1000, K=2, b=12, q=3, S=40),
        "conv varlen K4 bf16": lambda: check_conv_varlen("cuda", Dc=2560, K=4, S=40, act=torch.bfloat16,
                                                         strided=True, lengths=(1100, 0, 1, 2, 70, 65, 9, 3)),
    }
    for name, fn in checks.items():
        try:
            fn()
            print(f"PASS {name}", flush=True)
        except AssertionError as e:  # report every check, not only the first failure
            print(f"FAIL {name}: {e}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "gpu":
        sys.exit(run_gpu_smoke())
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.exit(run_interpreter(sys.argv[1]))
