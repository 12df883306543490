"""ReplaySSM forward and commit in Triton (twins of `ops/replay.py`).

Forward of a row with slot s, h_c = committed[s], o = ring_start[s], q new tokens:

    history j < h_c at ring row (o + j) mod R      new token t < q at row (o + h_c + t) mod R
    Λ = A * cumsum([Δ_hist, Δ_new])                (fp32, recomputed every step, all <= 0)
    y_t = e^{Λ_t} (S0 C_t) + Σ_j Δ_j e^{Λ_t-Λ_j} (B_j·C_t) x_j + Σ_{k<=t} (same, new) + D x_t

Routes (all read S0 once per row and write it only on flush rows):
- "fused" (`replay_step.py`): a per-group weights launch (B·C once per group, closed-form
  coefficients per head), then one output launch per (P tile, head, row) that also folds and
  writes the flush rows from the tile already in registers. Default for fp32 states.
- "split": the same two launches, flush rows folded by `replay_fold.py` afterwards (re-reads S0
  of flush rows only). Default for 16-bit states.
- "mma": tensor-core outputs (split-TF32 / 3xTF32 products) + `replay_fold.py`.
Appended rows never overlap history rows (h_c + q <= R), so no launch reads what it writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.replay_fold import launch_fold, replay_materialize_triton
from replayssm.ops.triton.replay_step import launch_step
from replayssm.ops.triton.replay_stream import launch_stream, stream_supported
from replayssm.ops.triton.ssu import LaunchConfig, softplus_dt

__all__ = ["replay_commit_triton", "replay_forward_triton", "replay_materialize_triton"]

# Routes and tiles from the H200 runs of benchmarks/bench_kernels.py (NOTES-kernels.md): every q
# takes the row-streaming route "stream-list" where its tiles fit (32x4 for one token, 64x4 for
# several), else replay_step.py (q = 1) or the tensor-core route (q > 1).
CONFIG = LaunchConfig(block_p=32, num_warps=4)
STREAM_CONFIGS = (LaunchConfig(block_p=32, num_warps=4), LaunchConfig(block_p=64, num_warps=4))
MMA_CONFIG = LaunchConfig(block_p=64, num_warps=4)
FOLD_CONFIG = LaunchConfig(block_p=32, num_warps=4)
BC_WARPS = 2


@triton.jit
def _replay_bc_kernel(
    B_ptr, C_ptr, rB_ptr, ring_start_ptr, committed_ptr, idx_ptr, cbh_ptr, cbn_ptr,
    sB_b, sB_t, sB_g, sC_b, sC_t, sC_g, G, R,
    Q: tl.constexpr, TB: tl.constexpr, HB: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Per (row, group): B_j·C_t for history and new tokens into scratch; append the new B rows."""
    i = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.load(idx_ptr + i)
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(s >= 0, tl.load(committed_ptr + s64), 0)  # padding rows: no history
    o = tl.load(ring_start_ptr + s64)
    n = tl.arange(0, BLOCK_N)
    nm = n < N
    j = tl.arange(0, HB)
    t = tl.arange(0, TB)
    tm = t < Q
    Brow0 = s64 * G * R + g * R
    jn = (j < hc)[:, None] & nm[None, :]
    Bh = tl.load(rB_ptr + (Brow0 + (o + j) % R)[:, None] * N + n[None, :], mask=jn, other=0.0)
    tn = tm[:, None] & nm[None, :]
    Bn = tl.load(B_ptr + i * sB_b + t[:, None] * sB_t + g * sB_g + n[None, :], mask=tn, other=0.0)
    C = tl.load(C_ptr + i * sC_b + t[:, None] * sC_t + g * sC_g + n[None, :], mask=tn, other=0.0)
    # 16-bit values are exact in TF32, so their products are exact in the fp32 accumulator;
    # fp32 activations take 3xTF32.
    Cf = C.to(tl.float32)
    if C_ptr.dtype.element_ty == tl.float32:
        cbh = tl.dot(Cf, tl.trans(Bh), input_precision="tf32x3")  # (TB, HB)
        cbn = tl.dot(Cf, tl.trans(Bn), input_precision="tf32x3")  # (TB, TB)
    else:
        cbh = tl.dot(Cf, tl.trans(Bh.to(tl.float32)), input_precision="tf32")
        cbn = tl.dot(Cf, tl.trans(Bn.to(tl.float32)), input_precision="tf32")
    base = i.to(tl.int64) * G + g
    tl.store(cbh_ptr + base * (Q * HB) + t[:, None] * HB + j[None, :], cbh, mask=tm[:, None])
    tl.store(cbn_ptr + base * (Q * TB) + t[:, None] * TB + t[None, :], cbn, mask=tm[:, None])
    tmv = tm & ((t * 0 + s) >= 0)  # validity as a tensor (a scalar bool in a mask trips the interpreter)
    arow = (o + hc + t) % R
    tl.store(rB_ptr + (Brow0 + arow)[:, None] * N + n[None, :], Bn, mask=tmv[:, None] & nm[None, :])


@triton.jit
def _replay_out_kernel(
    x_ptr, dt_ptr, A_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, rx_ptr, rdt_ptr, ring_start_ptr,
    committed_ptr, idx_ptr, y_ptr, cbh_ptr, cbn_ptr,
    sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sC_b, sC_t, sC_g, sy_b, sy_t, sy_h,
    H, G, R,
    Q: tl.constexpr, TB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):
    """Output-only route for one (P tile, head, row): reads S0, appends x (and Δ), no state write."""
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    s64 = tl.maximum(s, 0).to(tl.int64)
    hc = tl.where(valid, tl.load(committed_ptr + s64), 0)
    o = tl.load(ring_start_ptr + s64)
    g = h // (H // G)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = p < P
    pmv = pm & ((p * 0 + s) >= 0)
    t = tl.arange(0, TB)
    tm = t < Q
    j = tl.arange(0, HB)
    jm = j < hc
    sptr = state_ptr + (s64 * H + h) * (P * N) + p[:, None] * N + n[None, :]
    if EVEN:
        # Padding rows read slot 0 (valid memory) and are zeroed below: no masks on the big load.
        S0 = tl.load(sptr)
    else:
        S0 = tl.load(sptr, mask=pmv[:, None] & (n < N)[None, :], other=0.0)
    tn = tm[:, None] & (n < N)[None, :]
    C = tl.load(C_ptr + i * sC_b + t[:, None] * sC_t + g * sC_g + n[None, :], mask=tn, other=0.0)
    # Column t of acc is S0 C_t on this P tile: (BLOCK_P, TB). 16-bit values are exact in TF32,
    # so an fp32 S0 splits into hi + lo TF32 parts (two products, ~fp32 accuracy) and a 16-bit
    # S0 needs one; fp32 activations fall back to 3xTF32.
    if C_ptr.dtype.element_ty == tl.float32:
        acc = tl.dot(S0.to(tl.float32), tl.trans(C), input_precision="tf32x3")
    elif state_ptr.dtype.element_ty == tl.float32:
        hi = (S0.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        Ct = tl.trans(C.to(tl.float32))
        acc = tl.dot(hi, Ct, input_precision="tf32")
        acc = tl.dot(S0 - hi, Ct, acc, input_precision="tf32")
    else:
        acc = tl.dot(S0.to(tl.float32), tl.trans(C.to(tl.float32)), input_precision="tf32")
    # Decays of this head: Λ over [history, new tokens], recomputed from the stored Δ.
    A = tl.load(A_ptr + h)
    xrow0 = s64 * H * R + h * R
    dth = tl.load(rdt_ptr + xrow0 + (o + j) % R, mask=jm, other=0.0)
    cumh = tl.cumsum(dth, axis=0) * A
    dtn = tl.load(dt_ptr + i * sdt_b + t * sdt_t + h * sdt_h, mask=tm, other=0.0).to(tl.float32)
    dtn = tl.where(tm, softplus_dt(dtn, tl.load(dt_bias_ptr + h), DT_SOFTPLUS), 0.0)
    cumn = tl.sum(dth, axis=0) * A + tl.cumsum(dtn, axis=0) * A
    acc = acc * tl.exp(cumn)[None, :]
    # Weights, transposed for the products: w[j, t] = Δ_j e^{Λ_t-Λ_j} (B_j·C_t); exponents
    # clamped at 0 so masked entries cannot overflow before being zeroed.
    cbase = i.to(tl.int64) * G + g
    cbh = tl.load(cbh_ptr + cbase * (Q * HB) + t[None, :] * HB + j[:, None], mask=jm[:, None] & tm[None, :],
                  other=0.0)
    wh = dth[:, None] * tl.exp(tl.minimum(cumn[None, :] - cumh[:, None], 0.0)) * cbh  # (HB, TB)
    cbn = tl.load(cbn_ptr + cbase * (Q * TB) + t[None, :] * TB + t[:, None], mask=tm[:, None] & tm[None, :],
                  other=0.0)
    cumk = tl.cumsum(dtn, axis=0) * A
    wn = dtn[:, None] * tl.exp(tl.minimum(cumk[None, :] - cumk[:, None], 0.0)) * cbn  # (TB: k, TB: t)
    wn = tl.where(t[:, None] <= t[None, :], wn, 0.0)
    xh = tl.load(rx_ptr + (xrow0 + (o + j) % R)[None, :] * P + p[:, None], mask=pm[:, None] & jm[None, :],
                 other=0.0).to(tl.float32)  # (BLOCK_P, HB)
    acc = tl.dot(xh, wh, acc, input_precision="tf32x3")
    pt = pm[:, None] & tm[None, :]
    xn_raw = tl.load(x_ptr + i * sx_b + t[None, :] * sx_t + h * sx_h + p[:, None], mask=pt, other=0.0)
    xn = xn_raw.to(tl.float32)
    acc = tl.dot(xn, wn, acc, input_precision="tf32x3")
    acc = tl.where(valid, acc + tl.load(D_ptr + h) * xn, 0.0)
    yptr = y_ptr + i * sy_b + t[None, :] * sy_t + h * sy_h + p[:, None]
    tl.store(yptr, acc.to(y_ptr.dtype.element_ty), mask=pt)
    arow = (o + hc + t) % R
    tl.store(rx_ptr + (xrow0 + arow)[None, :] * P + p[:, None], xn_raw, mask=pmv[:, None] & tm[None, :])
    if pid_p == 0:
        tl.store(rdt_ptr + xrow0 + arow, dtn, mask=tm & ((t * 0 + s) >= 0))


def launch_replay_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                          state_indices, window, dt_softplus, rand_seed, out,
                          config: LaunchConfig | None = None, route: str = "auto") -> torch.Tensor:
    """Launch one forward step with an explicit tile config.

    route "stream-list" (and the other "stream*" variants): `replay_stream.py`; "fused":
    `replay_step.py`, flush folded in the output launch; "split": the same outputs, flush rows
    folded by `replay_fold.py`; "mma": tensor-core outputs + `replay_fold.py`; "auto":
    "stream-list" where its tiles fit, else "mma" for q > 1, "fused" (fp32 state) or "split";
    "weights": the weights launch alone (benchmark diagnostics only: y is not written).
    """
    b, q = x.shape[:2]
    assert state.is_contiguous() and ring_x.is_contiguous() and ring_B.is_contiguous()
    assert ring_dt.is_contiguous() and x.stride(3) == 1 and B.stride(3) == 1 and C.stride(3) == 1
    y = out if out is not None else torch.empty_like(x)
    if b == 0:
        return y
    if route == "auto":
        stream_cfg = STREAM_CONFIGS[q > 1]
        if config is None and stream_supported(state.shape[2], state.shape[3], stream_cfg.block_p):
            route, config = "stream-list", stream_cfg
        else:
            # The fused fold's stochastic rounding costs registers every program pays for (see
            # NOTES-kernels.md), so 16-bit states fold in their own launch.
            route = "mma" if q > 1 else "fused" if state.dtype == torch.float32 else "split"
    if route.startswith("stream"):
        # "stream[-split|-two|-list][.sSTAGES][.iITEMS][.c]" (replay_stream.py; .c: flush launch
        # concurrent on a side stream); benchmarks sweep them.
        name, *opts = route.split(".")
        kw = {dict(s="stages", i="items")[o[0]]: int(o[1:]) for o in opts if o != "c"}
        kw["concurrent"] = "c" in opts
        modes = {"stream": (3,), "stream-two": (1, 2), "stream-list": (1, 4), "stream-split": (0,)}[name]
        cfg = config or CONFIG
        if not stream_supported(state.shape[2], state.shape[3], cfg.block_p):
            raise ValueError(f"route {route!r} needs block_p dividing P and N a multiple of 32")
        if q > 1 and cfg.num_warps > 4:
            # Its tensor-core pieces hit an illegal memory access on the H200 with 8 warps (64x8,
            # q = 4, benchmark sweep); not established why, so as the mma route: at most 4.
            raise ValueError(f"config.num_warps must be at most 4 for {route!r} with q > 1")
        launch_stream(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                      state_indices, window, dt_softplus, rand_seed, y, cfg.block_p, cfg.num_warps,
                      modes=modes, **kw)
        if name != "stream-split":
            return y
    elif route in ("fused", "split", "weights"):
        cfg = config or CONFIG
        launch_step(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                    state_indices, window, dt_softplus, rand_seed, y, cfg.block_p, cfg.num_warps,
                    fuse_flush=route == "fused", outputs=route != "weights")
        if route != "split":
            return y
    else:
        _launch_mma(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                    state_indices, window, dt_softplus, y, config or MMA_CONFIG)
    launch_fold(state, ring_x, ring_B, ring_dt, A, ring_start, committed, state_indices, window, q, rand_seed,
                FOLD_CONFIG.block_p, FOLD_CONFIG.num_warps)
    return y


def _launch_mma(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                state_indices, window, dt_softplus, y, config: LaunchConfig) -> None:
    S, H, P, N = state.shape
    b, q = x.shape[:2]
    G, R = B.shape[2], ring_x.shape[2]
    if config.num_warps > 4:
        # On the H200 (Triton 3.6) this route gave wrong outputs with 8 warps (64x8 tile, GPU
        # test); the cause is not established, so only tiles of at most 4 warps are allowed.
        raise ValueError(f"config.num_warps must be at most 4 for the mma route, got {config.num_warps}")
    # Matrix-product operands need every dimension >= 16.
    TB, HB = max(16, triton.next_power_of_2(q)), max(16, triton.next_power_of_2(int(window)))
    BN = triton.next_power_of_2(N)
    cbh = torch.empty(b, G, q, HB, device=x.device, dtype=torch.float32)
    cbn = torch.empty(b, G, q, TB, device=x.device, dtype=torch.float32)
    _replay_bc_kernel[(b, G)](
        B, C, ring_B, ring_start, committed, state_indices, cbh, cbn,
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2), G, R,
        Q=q, TB=TB, HB=HB, N=N, BLOCK_N=BN, num_warps=BC_WARPS,
    )
    block_p = min(max(config.block_p, 16), max(16, triton.next_power_of_2(P)))
    _replay_out_kernel[(triton.cdiv(P, block_p), H, b)](
        x, dt, A, C, D, dt_bias, state, ring_x, ring_dt, ring_start, committed, state_indices, y, cbh, cbn,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), dt.stride(2),
        C.stride(0), C.stride(1), C.stride(2), y.stride(0), y.stride(1), y.stride(2), H, G, R,
        Q=q, TB=TB, HB=HB, P=P, N=N, BLOCK_P=block_p, BLOCK_N=BN, EVEN=(P % block_p == 0) and BN == N,
        DT_SOFTPLUS=bool(dt_softplus), num_warps=config.num_warps,
    )


def replay_forward_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    ring_x: torch.Tensor,
    ring_B: torch.Tensor,
    ring_dt: torch.Tensor,
    ring_start: torch.Tensor,
    committed: torch.Tensor,
    state_indices: torch.Tensor,
    window: int,
    *,
    dt_softplus: bool = True,
    rand_seed: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """ReplaySSM forward (API.md `replay_forward`); arguments validated by the public op.

    x (b,q,H,P); dt (b,q,H) raw; B, C (b,q,G,N); state (S,H,P,N), written only on flush rows;
    ring_x (S,H,R,P), ring_B (S,G,R,N), ring_dt (S,H,R) fp32: the q new entries are appended;
    ring_start, committed (S,) int32 read-only; state_indices (b,) int32, -1 = padding.
    Returns y (b,q,H,P) in x.dtype (zero rows for padding).
    """
    return launch_replay_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start,
                                 committed, state_indices, window, dt_softplus, rand_seed, out)


@triton.jit
def _replay_commit_kernel(ring_start_ptr, committed_ptr, idx_ptr, acc_ptr, b, q, window, ring_rows,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(idx_ptr + i, mask=i < b, other=-1)
    m = s >= 0
    s = tl.maximum(s, 0)
    hc = tl.load(committed_ptr + s, mask=m, other=0)
    o = tl.load(ring_start_ptr + s, mask=m, other=0)
    a = tl.load(acc_ptr + i, mask=m, other=0)
    # Decided from the pre-commit cursor, exactly as the forward decided its flush.
    flushed = hc + q > window
    start = tl.where(flushed, o + hc, o)
    if HAS_ROWS:
        start = start % ring_rows
    tl.store(ring_start_ptr + s, start, mask=m)
    tl.store(committed_ptr + s, tl.where(flushed, a, hc + a), mask=m)


def replay_commit_triton(ring_start: torch.Tensor, committed: torch.Tensor, state_indices: torch.Tensor,
                         num_accepted: torch.Tensor, q: int, window: int, *,
                         ring_rows: int | None = None) -> None:
    """Cursor commit on device (API.md `replay_commit`); padding rows untouched, no host sync."""
    b = state_indices.shape[0]
    if b == 0:
        return
    block = 128
    _replay_commit_kernel[(triton.cdiv(b, block),)](
        ring_start, committed, state_indices, num_accepted, b, int(q), int(window),
        int(ring_rows) if ring_rows is not None else 1,
        HAS_ROWS=ring_rows is not None, BLOCK=block, num_warps=4,
    )
