"""The flush rows of a one-token ReplaySSM forward step (route `Lean`): listed on the device, then
folded by a persistent launch.

A list kernel (one program) writes a record (row, slot, h_c, ring start) per row that flushes this
step (h_c + Q > W); the persistent launch walks the (head, P tile) pieces of the listed rows on a
fixed grid of a few programs per SM, so few flush rows still spread over every SM and the fold's
registers never throttle the launch that streams the other rows. A piece writes the row's y from
its tile and the ring term r (`replay_ring.py`), then folds
    S0 <- e^{Λ_h} S0 + Σ_j f_j x_j B_jᵀ
from the weights launch's scratch (`replay_step.py`). `fold_chunks` is the fold of route `Mono`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.triton.rounding import (
    device_seed,
    load_seed_mix,
    max_finite,
    stochastic_round_pairs,
    tl_dtype,
)

FLUSH_PROGRAMS_PER_SM = 4
# Rows per iteration of the one-program flush list kernels: fixed, so every batch size (every CUDA
# graph bucket) shares one compiled kernel instead of compiling its own mid-run.
LIST_BLOCK = 1024


@triton.jit
def fold_chunks(state_ptr, rB_ptr, xf, decay, rows, jm, p, sbase, Brow0, seed_mix, N: tl.constexpr,
                CW: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr):
    """S0 <- decay S0 + xf B_rowsᵀ over a (BLOCK_P, N) tile, CW columns at a time: one (BLOCK_P, KB) x
    (KB, CW) 3xTF32 product per chunk onto the decayed chunk, rounded and stored (xf: the history x
    scaled by the fold coefficients, zero past h_c; jm masks the history B rows)."""
    for c in tl.static_range(N // CW):
        n = c * CW + tl.arange(0, CW)
        tile = p[:, None] * N + n[None, :]
        S0 = tl.load(state_ptr + sbase + tile).to(tl.float32)
        Bc = tl.load(rB_ptr + (Brow0 + rows)[:, None] * N + n[None, :], mask=jm[:, None],
                     other=0.0).to(tl.float32)  # (KB, CW)
        S = tl.dot(xf, Bc, S0 * decay, input_precision="tf32x3")
        val = stochastic_round_pairs(S, sbase + tile, seed_mix, STATE_DTYPE, MAXV, N)
        tl.store(state_ptr + sbase + tile, val)


@triton.jit
def _lean_list_kernel(idx_ptr, committed_ptr, ring_start_ptr, list_ptr, count_ptr, b, window, Q: tl.constexpr,
                      BLOCK: tl.constexpr):
    # One program: a record (row, slot, h_c, ring start) per row that flushes this step, in row
    # order, and their count; a flush piece then waits on one record load, not on a chain.
    base = 0
    for start in range(0, b, BLOCK):
        r = start + tl.arange(0, BLOCK)
        s = tl.load(idx_ptr + r, mask=r < b, other=-1)
        sm = tl.maximum(s, 0)
        hc = tl.load(committed_ptr + sm, mask=s >= 0, other=0)
        o = tl.load(ring_start_ptr + sm, mask=s >= 0, other=0)
        f = (s >= 0) & (hc + Q > window)
        at = (base + tl.cumsum(f.to(tl.int32), axis=0) - 1) * 4
        tl.store(list_ptr + at, r, mask=f)
        tl.store(list_ptr + at + 1, s, mask=f)
        tl.store(list_ptr + at + 2, hc, mask=f)
        tl.store(list_ptr + at + 3, o, mask=f)
        base += tl.sum(f.to(tl.int32), axis=0)
    tl.store(count_ptr, base)


@triton.jit
def _lean_flush_kernel(
    list_ptr, count_ptr, C_ptr, state_ptr, rx_ptr, rB_ptr, y_ptr, w_ptr, sc_ptr, r_ptr, seed_ptr,
    sC_b, sC_g, sy_b, sy_h, H, G, R, b, few,
    Q: tl.constexpr, QB: tl.constexpr, HB: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, STATE_DTYPE: tl.constexpr, MAXV: tl.constexpr, FEW: tl.constexpr = False,
):
    seed_mix = load_seed_mix(seed_ptr, STATE_DTYPE)
    # Persistent over the (head, P tile) pieces of the listed rows (one token each). A piece loads its
    # tile once, writes y = e^{Λ} (S0 C) + r, then folds S0 <- e^{Λ_h} S0 + Σ_j f_j x_j B_jᵀ with one
    # (BLOCK_P, KB) x (KB, N) 3xTF32 tensor-core product onto the decayed tile (~2^-21 relative error
    # per product against fp32's 2^-24) and writes it.
    NPT: tl.constexpr = P // BLOCK_P
    KB: tl.constexpr = 16 if HB < 16 else HB
    JB: tl.constexpr = HB + QB
    per_row = H * NPT
    end = tl.load(count_ptr) * per_row
    nprog = tl.num_programs(0)
    if FEW:
        # While at most half the rows flush, only the first `few` programs work (the rest of the grid
        # exits): fewer fold programs beside the output launch, the whole grid for a step where the
        # batch flushes at once.
        nprog = tl.where(end <= b * per_row // 2, tl.minimum(few, nprog), nprog)
        end = tl.where(tl.program_id(0) < nprog, end, 0)
    for w in range(tl.program_id(0), end, nprog):
        e = list_ptr + (w // per_row) * 4
        i = tl.load(e)
        s64 = tl.load(e + 1).to(tl.int64)
        hc = tl.load(e + 2)
        o = tl.load(e + 3)
        piece = w % per_row
        h = piece // NPT
        p = (piece % NPT) * BLOCK_P + tl.arange(0, BLOCK_P)
        g = h // (H // G)
        sbase = (s64 * H + h) * (P * N)
        scbase = (i.to(tl.int64) * H + h) * (Q + 1)
        wf = (i.to(tl.int64) * H + h) * ((Q + 1) * JB) + Q * JB
        xrow0 = s64 * H * R + h * R
        Brow0 = s64 * G * R + g * R
        n = tl.arange(0, N)
        tile = p[:, None] * N + n[None, :]
        S0 = tl.load(state_ptr + sbase + tile).to(tl.float32)
        Ct = tl.load(C_ptr + i * sC_b + g * sC_g + n).to(tl.float32)
        yt = tl.load(sc_ptr + scbase) * tl.sum(S0 * Ct[None, :], axis=1)
        yt += tl.load(r_ptr + (i.to(tl.int64) * H + h) * P + p)
        tl.store(y_ptr + i * sy_b + h * sy_h + p, yt.to(y_ptr.dtype.element_ty))
        j = tl.arange(0, KB)
        jm = j < hc
        rows = (o + j) % R
        f = tl.load(w_ptr + wf + j, mask=jm, other=0.0)
        xf = tl.load(rx_ptr + (xrow0 + rows)[None, :] * P + p[:, None], mask=jm[None, :],
                     other=0.0).to(tl.float32) * f[None, :]  # (BLOCK_P, KB)
        Bh = tl.load(rB_ptr + (Brow0 + rows)[:, None] * N + n[None, :], mask=jm[:, None],
                     other=0.0).to(tl.float32)  # (KB, N)
        S = tl.dot(xf, Bh, S0 * tl.load(sc_ptr + scbase + Q), input_precision="tf32x3")
        val = stochastic_round_pairs(S, sbase + tile, seed_mix, STATE_DTYPE, MAXV, N)
        tl.store(state_ptr + sbase + tile, val)


def launch_flush(C, state, ring_x, ring_B, ring_start, committed, state_indices, window, rand_seed, y, w, sc,
                 r, block_p: int, num_warps: int, few_programs_per_sm: int = 0) -> None:
    """List the rows that flush this step (one token each), then write their y from r and fold them
    with a persistent launch of FLUSH_PROGRAMS_PER_SM programs per SM (tiles of >= 16 rows). w, sc: the
    weights launch's scratch; r: the ring term. few_programs_per_sm (0: off): on steps where at most
    half the rows flush, only that many programs per SM work (decided on the device from the list's
    count)."""
    S, H, P, N = state.shape
    b, q = C.shape[:2]
    G, R = ring_B.shape[1], ring_x.shape[2]
    assert q == 1 and block_p >= 16
    sdt = tl_dtype(state.dtype)
    records = torch.empty(b, 4, device=C.device, dtype=torch.int32)
    count = torch.empty(1, device=C.device, dtype=torch.int32)
    _lean_list_kernel[(1,)](state_indices, committed, ring_start, records, count, b, int(window), Q=q,
                            BLOCK=LIST_BLOCK, num_warps=4)
    programs = min(b * H * (P // block_p), flush_programs(C.device))
    _lean_flush_kernel[(programs,)](
        records, count, C, state, ring_x, ring_B, y, w, sc, r, device_seed(rand_seed, state.device),
        C.stride(0), C.stride(2), y.stride(0), y.stride(2), H, G, R, b,
        flush_programs(C.device, few_programs_per_sm) if few_programs_per_sm else 0,
        Q=q, QB=triton.next_power_of_2(q), HB=triton.next_power_of_2(int(window)), P=P, N=N, BLOCK_P=block_p,
        STATE_DTYPE=sdt, MAXV=max_finite(sdt), FEW=few_programs_per_sm > 0, num_warps=num_warps,
    )


def flush_programs(device: torch.device, per_sm: int = FLUSH_PROGRAMS_PER_SM) -> int:
    """Programs of a persistent flush launch: per_sm per SM (the CPU interpreter counts one SM)."""
    if device.type != "cuda":
        return per_sm
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
