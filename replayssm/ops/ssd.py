"""Chunked SSD prefill scan (Mamba-2 "state space duality") over packed variable-length sequences.

Every sequence is cut into chunks of `chunk_size` tokens that never cross a sequence boundary
(the last chunk of a sequence is padded with Δ = 0 tokens, which leave the state unchanged).
Per chunk, with a_k = Δ_k A and the segment sum seg(i, j) = a_{j+1} + ... + a_i (i >= j):

    y_i      = Σ_{j<=i} (C_i·B_j) exp(seg(i, j)) Δ_j x_j         quadratic, attention-like
             + exp(a_1 + ... + a_i) S_in C_i + D x_i              carried state
    S_chunk  = Σ_j exp(seg(last, j)) Δ_j x_j B_jᵀ                 state of the chunk from zero
    S_in'    = exp(a_1 + ... + a_last) S_in + S_chunk             passed to the next chunk

The chunk-to-chunk pass is a short loop over chunk positions, vectorized over sequences.
All math is fp32; the final states are written with stochastic rounding for fp16/bf16 pools.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from replayssm.ops._checks import (
    FLOAT_DTYPES,
    check_group_count,
    check_indices,
    check_int,
    check_params,
    check_tensor,
)
from replayssm.ops.common import pick_impl, softplus_dt, store_states
from replayssm.ops.rounding import resolve_seed
from replayssm.ops.ssd_layout import ChunkLayout, chunk_layout


def _segsum_exp(a: Tensor) -> Tensor:
    """exp(seg(i, j)) for i >= j, 0 above the diagonal. a (..., L) -> (..., L, L).

    Built as a masked cumsum rather than a difference of prefix sums, so decays close to 1
    keep full fp32 precision however negative the prefix sums get.
    """
    L = a.shape[-1]
    on_or_above, above = _triu_masks(L, a.device)
    seg = torch.cumsum(a[..., :, None].expand(*a.shape, L).masked_fill(on_or_above, 0.0), dim=-2)
    return torch.exp(seg.masked_fill_(above, float("-inf")))


@functools.cache
def _triu_masks(L: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(on or above, strictly above) the diagonal, (L, L) bool; made once per size and device."""
    ones = torch.ones(L, L, dtype=torch.bool, device=device)
    return torch.triu(ones), torch.triu(ones, diagonal=1)


def ssd_chunked_scan_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    *,
    chunk_size: int = 64,
    dt_softplus: bool = True,
    rand_seed: torch.Tensor | None = None,
    boundary_seq: Tensor | None = None,
    boundary_len: Tensor | None = None,
    boundary_dst: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Reference of `ssd_chunked_scan` (same signature): chunked, vectorized, fp32.

    Reads its metadata (cu_seqlens, slots, flags, boundaries) on the host once per set of
    metadata tensors: the layers of one forward pass share it (ops/ssd_layout.py).
    """
    lay = chunk_layout(cu_seqlens, state_indices, has_initial_state, boundary_seq, boundary_len, chunk_size,
                       x.shape[0])
    out, pieces = scan_without_boundaries(x, dt, A, B, C, D, dt_bias, state, lay, chunk_size, dt_softplus,
                                          rand_seed)
    if boundary_seq is None:
        return out, None
    states = _boundary_states(lay, *pieces)
    if boundary_dst is None:
        return out, states
    store_states(state, boundary_dst.long(), states, rand_seed)
    return out, None


def scan_without_boundaries(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor, state: Tensor,
    lay: ChunkLayout, chunk_size: int, dt_softplus: bool, rand_seed: torch.Tensor | None,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The reference scan up to the boundary states: (y, (init, s_in, decay, a_cum, dx, Bc)).

    Writes the final states; s_in (nc, H, P, N) fp32 is the state entering each chunk.
    """
    T, H, P = x.shape
    N = B.shape[2]
    L = chunk_size
    nc, n = lay.nc, lay.num_seqs

    delta = softplus_dt(dt, dt_bias, dt_softplus)[lay.idx]  # (nc, L, H)
    if lay.pad is not None:  # Δ = 0 past a sequence's end: no decay, no input
        delta.masked_fill_(lay.pad, 0.0)
    Bc, Cc = B[lay.idx].float(), C[lay.idx].float()  # (nc, L, G, N): kept per group, never expanded to heads
    G = Bc.shape[2]
    a = (delta * A.float()).transpose(1, 2)  # (nc, H, L)
    decay = _segsum_exp(a)  # (nc, H, L, L)
    a_cum = torch.cumsum(a, dim=-1)  # (nc, H, L): from chunk start, inclusive
    # Δ_j x_j with heads split as (group, head in group): (nc, L, G, H/G, P)
    xc = x[lay.idx].float()  # (nc, L, H, P)
    dx = (delta[..., None] * xc).view(nc, L, G, H // G, P)

    # Intra-chunk (quadratic) outputs and the chunk states from zero.
    cb = torch.einsum("cign,cjgn->cgij", Cc, Bc)  # (nc, G, L, L)
    scores = cb[:, :, None] * decay.view(nc, G, H // G, L, L)
    y = torch.einsum("cgkij,cjgkp->cigkp", scores, dx).reshape(nc, L, H, P)
    to_end = decay[:, :, -1, :].view(nc, G, H // G, L)  # exp(seg(last, j))
    s_chunk = torch.einsum("cgkj,cjgkp,cjgn->cgkpn", to_end, dx, Bc).reshape(nc, H, P, N)

    # Chunk-to-chunk pass over chunk positions; sequences in rank order (ops/ssd_layout.py).
    init = _initial_states(state, lay, (n, H, P, N))
    chunk_decay = torch.exp(a_cum[:, :, -1])[:, :, None, None]  # (nc, H, 1, 1)
    s_in = s_chunk.new_empty(nc, H, P, N)
    final = init.clone() if not lay.positions or lay.positions[0][1] < n else init.new_empty(n, H, P, N)
    if lay.positions:
        o, m, _ = lay.positions[0]
        s_in[o : o + m] = init[:m]
    for o, m, m_next in lay.positions:
        # Sequences going on get the next position's incoming state; those ending here their final.
        o_next = o + m
        if m_next:
            torch.addcmul(s_chunk[o : o + m_next], chunk_decay[o : o + m_next], s_in[o : o + m_next],
                          out=s_in[o_next : o_next + m_next])
        if m_next < m:
            torch.addcmul(s_chunk[o + m_next : o_next], chunk_decay[o + m_next : o_next],
                          s_in[o + m_next : o_next], out=final[m_next:m])

    carried = torch.einsum("cgkpn,cign->cigkp", s_in.view(nc, G, H // G, P, N), Cc).reshape(nc, L, H, P)
    y = y + torch.exp(a_cum).transpose(1, 2)[..., None] * carried
    y = y + D.float()[:, None] * xc
    out = y[lay.token_chunk, lay.token_offset]
    if lay.token_valid is not None:  # padding sequences output zeros
        out = torch.where(lay.token_valid, out, 0.0)
    out = out.to(x.dtype)

    if lay.store_rows is None:
        store_states(state, lay.store_slots, final, rand_seed)
    else:
        store_states(state, lay.store_slots, final[lay.store_rows], rand_seed)
    return out, (init, s_in, decay, a_cum, dx, Bc)


def _initial_states(state: Tensor, lay: ChunkLayout, shape: tuple[int, ...]) -> Tensor:
    """(n, H, P, N) fp32 initial state of each sequence in rank order (zeros without one)."""
    if lay.init_mode == "none":
        return torch.zeros(shape, dtype=torch.float32, device=state.device)
    init = state[lay.read_slots].float()
    if lay.init_mode == "some":
        init = torch.where(lay.use_init[:, None, None, None], init, 0.0)
    return init


def _boundary_states(
    lay: ChunkLayout,
    init: Tensor,
    s_in: Tensor,
    decay: Tensor,
    a_cum: Tensor,
    dx: Tensor,
    Bc: Tensor,
) -> Tensor:
    """Exact fp32 state of sequence boundary_seq[j] after its first boundary_len[j] tokens: (m, H, P, N)."""
    if lay.nc == 0:  # no tokens at all: every boundary is an initial state
        return init[lay.b_rank]
    # Zero-length boundaries point at chunk 0; their result is replaced by the initial state below.
    c, t = lay.b_chunk, lay.b_offset
    weights = decay[c, :, t, :]  # (m, H, L): exp(seg(t, r)), zero for r > t
    m, L, G, k = len(c), dx.shape[1], dx.shape[2], dx.shape[3]
    inner = torch.einsum("mgkr,mrgkp,mrgn->mgkpn", weights.view(m, G, k, L), dx[c], Bc[c])
    inner = inner.reshape(m, G * k, dx.shape[4], Bc.shape[3])
    states = torch.addcmul(inner, torch.exp(a_cum[c, :, t])[:, :, None, None], s_in[c])
    if lay.b_empty is not None:
        states = torch.where(lay.b_empty, init[lay.b_rank], states)
    return states


def _check_args(
    x, dt, A, B, C, D, dt_bias, state, cu_seqlens, state_indices, has_initial_state,
    chunk_size, rand_seed, boundary_seq, boundary_len, boundary_dst,
) -> None:  # fmt: skip
    check_tensor("x", x, (None, None, None), FLOAT_DTYPES)
    T, H, P = x.shape
    dev = x.device
    check_tensor("dt", dt, (T, H), FLOAT_DTYPES, dev)
    check_tensor("B", B, (T, None, None), (x.dtype,), dev)
    check_group_count("B", H, B.shape[1])
    check_tensor("C", C, tuple(B.shape), (x.dtype,), dev)
    check_params(A, D, dt_bias, H, dev)
    check_tensor("state", state, (None, H, P, B.shape[2]), FLOAT_DTYPES, dev)
    check_tensor("cu_seqlens", cu_seqlens, (None,), (torch.int32,), dev)
    n = cu_seqlens.shape[0] - 1
    if n < 0:
        raise ValueError("cu_seqlens: needs at least one entry")
    check_indices("state_indices", state_indices, (n,), state.shape[0], dev, unique=True)
    check_tensor("has_initial_state", has_initial_state, (n,), (torch.bool,), dev)
    check_int("chunk_size", chunk_size, 1)
    if cu_seqlens.device.type == "cpu":
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens: must rise from 0 to T={T}, got {cu}")
    if (boundary_seq is None) != (boundary_len is None):
        raise ValueError("boundary_seq and boundary_len must be given together")
    if boundary_seq is None:
        if boundary_dst is not None:
            raise ValueError("boundary_dst: needs boundary_seq and boundary_len")
        return
    if boundary_dst is not None:
        check_indices("boundary_dst", boundary_dst, tuple(boundary_seq.shape), state.shape[0], dev,
                      allow_padding=False, unique=True)
        if boundary_dst.device.type == "cpu" and state_indices.device.type == "cpu":
            if set(boundary_dst.tolist()) & set(state_indices.tolist()):
                raise ValueError("boundary_dst: must not name a slot of state_indices")
    check_indices("boundary_seq", boundary_seq, (None,), n, dev, allow_padding=False)
    check_tensor("boundary_len", boundary_len, tuple(boundary_seq.shape), (torch.int32,), dev)
    if boundary_len.device.type == "cpu" and cu_seqlens.device.type == "cpu" and boundary_len.numel():
        seq_len = (cu_seqlens[1:] - cu_seqlens[:-1])[boundary_seq.long()]
        if bool((boundary_len < 0).any()) or bool((boundary_len > seq_len).any()):
            raise ValueError(f"boundary_len: must lie in [0, sequence length], got {boundary_len.tolist()}")


def ssd_chunked_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    *,
    chunk_size: int = 64,
    dt_softplus: bool = True,
    rand_seed: torch.Tensor | None = None,
    boundary_seq: Tensor | None = None,
    boundary_len: Tensor | None = None,
    boundary_dst: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Mamba-2 prefill over packed sequences, from and into pooled states; returns (y, boundary_states).

    x (T, H, P); dt (T, H) raw; B, C (T, G, N) in x.dtype; A, D, dt_bias (H,) fp32;
    state (S, H, P, N) fp32/fp16/bf16; cu_seqlens (n+1,) int32; state_indices (n,) int32
    (-1 = padding sequence: zero outputs, no slot read or written); has_initial_state (n,)
    bool (False: start from zeros). The final state of each sequence is written to its slot
    (stochastic rounding with rand_seed for fp16/bf16 pools). boundary_seq, boundary_len (m,)
    int32: also return the exact fp32 state of sequence boundary_seq[j] after its first
    boundary_len[j] tokens of this call, (m, H, P, N); None when not asked. boundary_dst (m,)
    int32/int64, distinct slots outside state_indices: store those states into state[boundary_dst]
    instead (rounded like the final states; as `store_states` would) and return None for them.
    y (T, H, P) in x.dtype. Dispatches to Triton for CUDA tensors when it imports.
    """
    _check_args(
        x, dt, A, B, C, D, dt_bias, state, cu_seqlens, state_indices, has_initial_state,
        chunk_size, rand_seed, boundary_seq, boundary_len, boundary_dst,
    )  # fmt: skip
    rand_seed = resolve_seed(rand_seed, state.device)
    args = (x, dt, A, B, C, D, dt_bias, state, cu_seqlens, state_indices, has_initial_state)
    kwargs = dict(
        chunk_size=chunk_size, dt_softplus=dt_softplus, rand_seed=rand_seed,
        boundary_seq=boundary_seq, boundary_len=boundary_len, boundary_dst=boundary_dst,
    )  # fmt: skip
    return pick_impl("ssd", "ssd_chunked_scan", x, ssd_chunked_scan_ref)(*args, **kwargs)
