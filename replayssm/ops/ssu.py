"""Baseline Mamba-2 selective state update (ReplaySSM off): read and write the state every step.

Plain decode (q = 1) reads state[s], runs one token and writes it back. Speculative verify
(dst_indices given) reads state[s] once and writes the state after each of the q tokens into
its own slot dst_indices[i, t]; the engine then keeps the slot of the last accepted token.
This is the path ReplaySSM is measured against, so it must stay correct and simple.
"""

from __future__ import annotations

import torch

from replayssm.ops._checks import (
    FLOAT_DTYPES,
    check_group_count,
    check_indices,
    check_params,
    check_tensor,
)
from replayssm.ops.common import heads_from_groups, pick_impl, softplus_dt, store_states
from replayssm.ops.rounding import resolve_seed


def _check_args(state, x, dt, A, B, C, D, dt_bias, state_indices, dst_indices, rand_seed, out) -> None:
    check_tensor("state", state, (None, None, None, None), FLOAT_DTYPES)
    num_slots, H, P, N = state.shape
    dev = state.device
    check_tensor("x", x, (None, None, H, P), FLOAT_DTYPES, dev)
    b, q = x.shape[:2]
    check_tensor("dt", dt, (b, q, H), FLOAT_DTYPES, dev)
    check_tensor("B", B, (b, q, None, N), (x.dtype,), dev)
    check_group_count("B", H, B.shape[2])
    check_tensor("C", C, tuple(B.shape), (x.dtype,), dev)
    check_params(A, D, dt_bias, H, dev)
    check_indices("state_indices", state_indices, (b,), num_slots, dev, unique=dst_indices is None)
    if dst_indices is not None:
        check_indices("dst_indices", dst_indices, (b, q), num_slots, dev, unique=True)
    if out is not None:
        check_tensor("out", out, tuple(x.shape), (x.dtype,), dev)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    dst_indices: torch.Tensor | None = None,
    dt_softplus: bool = True,
    rand_seed: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run q tokens per row through the Mamba-2 recurrence from pooled states; return y.

    state (S, H, P, N) fp32/fp16/bf16 pool; x (b, q, H, P); dt (b, q, H) raw; B, C (b, q, G, N);
    A, D, dt_bias (H,) fp32; state_indices (b,) int32 (-1 = padding row: y rows zero, no slot
    touched). dst_indices (b, q) int32 or None: None writes the final state back to
    state[state_indices[i]]; otherwise the state after token t goes to state[dst_indices[i, t]]
    (-1 skips) and all sources are read before any write. fp16/bf16 writes round
    stochastically with rand_seed. Returns y (b, q, H, P) in x.dtype (written into out if given).
    Dispatches to Triton for CUDA tensors when it is importable, else to the PyTorch reference.
    """
    _check_args(state, x, dt, A, B, C, D, dt_bias, state_indices, dst_indices, rand_seed, out)
    rand_seed = resolve_seed(rand_seed, state.device)
    args = (state, x, dt, A, B, C, D, dt_bias, state_indices)
    kwargs = dict(dst_indices=dst_indices, dt_softplus=dt_softplus, rand_seed=rand_seed, out=out)
    return pick_impl("ssu", "selective_state_update", x, selective_state_update_ref)(*args, **kwargs)


def selective_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    dst_indices: torch.Tensor | None = None,
    dt_softplus: bool = True,
    rand_seed: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference of `selective_state_update` (same contract), vectorized over rows, fp32 math."""
    b, q, H, P = x.shape
    if out is None:
        out = torch.empty_like(x)
    out.zero_()  # padding rows must read as zeros
    rows = (state_indices >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    slots = state_indices[rows].long()

    # Gather every source state before any write: a dst slot may be another row's source.
    S = state[slots].float()  # (n, H, P, N)
    delta = softplus_dt(dt[rows], dt_bias, dt_softplus)  # (n, q, H)
    decay = torch.exp(delta * A.float())
    xs = x[rows].float()
    Bh = heads_from_groups(B[rows].float(), H)  # (n, q, H, N)
    Ch = heads_from_groups(C[rows].float(), H)
    Df = D.float()[:, None]

    ys, after = [], []
    for t in range(q):
        S = decay[:, t, :, None, None] * S + (delta[:, t, :, None, None] * xs[:, t, :, :, None]) * Bh[
            :, t, :, None, :
        ]
        ys.append(torch.einsum("nhpk,nhk->nhp", S, Ch[:, t]) + Df * xs[:, t])
        after.append(S)
    out[rows] = torch.stack(ys, dim=1).to(out.dtype)

    if dst_indices is None:
        store_states(state, slots, S, rand_seed)
        return out
    # One write per (row, token) with a destination; -1 entries are skipped.
    dst = dst_indices[rows].long()  # (n, q)
    keep = dst >= 0
    store_states(state, dst[keep], torch.stack(after, dim=1)[keep], rand_seed)
    return out
