"""ReplaySSM decode ops: outputs from checkpoint + ring of cached inputs, state write only on flush.

Per slot s: checkpoint state[s] = S_0, ring rows of (x, B, Δ), cursors o = ring_start[s] and
h = committed[s]. History entry j < h lives at ring row (o + j) mod R. A decode row with q new
tokens reads S_0 and the h history entries, appends its q entries after them, and folds the
history into S_0 (the only state write) when h + q > W. Commit then moves the cursors by the
number of accepted tokens a; rejected drafts stay in the ring past `committed` and are
overwritten by the next step (rollback is a cursor move).

Example, W = 4, q = 2, R = W + q = 6. [..] history rows read, <..> rows appended:

    step  (o, h) before  history read  appended     h+q > W?              a   (o, h) after
    1     (0, 0)         -             <0 1>        no                    2   (0, 2)
    2     (0, 2)         [0 1]         <2 3>        no                    1   (0, 3)
    3     (0, 3)         [0 1 2]       <3 4>        yes: fold 0-2 to S_0  2   (3, 2)
    4     (3, 2)         [3 4]         <5 0> wraps  no (h+q == W)         2   (3, 4)
    5     (3, 4)         [3 4 5 0]     <1 2>        yes: fold 4 entries   1   (1, 1)

On step 2 the token at row 3 was rejected: it stays there and step 3 overwrites it. After
every commit the slot holds S_0 after (c - h) tokens plus h ring entries (c = tokens computed).
Flush is strictly `h + q > W`: with `>=`, step 4 would fold early and lose a ring's worth of
replay (a known accuracy bug). Λ is recomputed from the stored Δ on every call, never stored.
"""

from __future__ import annotations

import torch

from replayssm.ops._checks import (
    FLOAT_DTYPES,
    check_group_count,
    check_indices,
    check_int,
    check_params,
    check_tensor,
)
from replayssm.ops.common import heads_from_groups, pick_impl, softplus_dt, store_states
from replayssm.ops.rounding import resolve_seed


def _check_cache(state, ring_x, ring_B, ring_dt, ring_start, committed, act_dtypes) -> None:
    """Shapes and dtypes of the per-slot tensors; cursor ranges on CPU (committed checked by callers)."""
    check_tensor("state", state, (None, None, None, None), FLOAT_DTYPES)
    num_slots, H, P, N = state.shape
    dev = state.device
    check_tensor("ring_x", ring_x, (num_slots, H, None, P), act_dtypes, dev)
    R = ring_x.shape[2]
    check_tensor("ring_B", ring_B, (num_slots, None, R, N), (ring_x.dtype,), dev)
    check_group_count("ring_B", H, ring_B.shape[1])
    check_tensor("ring_dt", ring_dt, (num_slots, H, R), (torch.float32,), dev)
    check_cursors(ring_start, committed, num_slots, dev)


def check_cursors(ring_start, committed, num_slots: int, device: torch.device) -> None:
    """ring_start, committed: int32 (S,); on CPU both must be non-negative."""
    for name, t in (("ring_start", ring_start), ("committed", committed)):
        check_tensor(name, t, (num_slots,), (torch.int32,), device)
        if t.device.type == "cpu" and t.numel() and int(t.min()) < 0:
            raise ValueError(f"{name}: cursors must be >= 0, got {t.tolist()}")


def _gather_history(ring_x, ring_B, ring_dt, slots, start, count, length: int):
    """First `count` ring entries of each slot, padded to `length` with zeros (Δ = 0 is a no-op step).

    slots, start, count: (n,) int64. Returns x (n, L, H, P), B per head (n, L, H, N), Δ (n, L, H),
    all fp32. Rows past `count` may hold rejected drafts or garbage: they are masked, not read.
    """
    R = ring_x.shape[2]
    j = torch.arange(length, device=slots.device)
    rows = (start[:, None] + j) % R  # (n, L)
    valid = j[None, :] < count[:, None]
    s = slots[:, None]
    xs = ring_x[s, :, rows].float()  # (n, L, H, P): the advanced indices go first
    Bs = heads_from_groups(ring_B[s, :, rows].float(), ring_x.shape[1])
    ds = ring_dt[s, :, rows]
    xs = torch.where(valid[:, :, None, None], xs, 0.0)
    Bs = torch.where(valid[:, :, None, None], Bs, 0.0)
    ds = torch.where(valid[:, :, None], ds, 0.0)
    return xs, Bs, ds


def _fold(S0: torch.Tensor, xs, Bs, deltas, A: torch.Tensor) -> torch.Tensor:
    """State after all L entries from S0 (n, H, P, N), in closed form:

    exp(Λ_L) S0 + Σ_j Δ_j exp(Λ_L - Λ_j) x_j B_jᵀ.
    """
    lam = torch.cumsum(deltas * A, dim=1)  # (n, L, H), ≤ 0 and non-increasing
    lam_end = lam[:, -1]
    w = deltas * torch.exp((lam_end[:, None] - lam).clamp_max(0.0))
    return torch.exp(lam_end)[:, :, None, None] * S0 + torch.einsum("nlh,nlhp,nlhk->nhpk", w, xs, Bs)


def _check_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                   state_indices, window, rand_seed, out) -> None:
    _check_cache(state, ring_x, ring_B, ring_dt, ring_start, committed, FLOAT_DTYPES)
    num_slots, H, P, N = state.shape
    dev, R = state.device, ring_x.shape[2]
    check_tensor("x", x, (None, None, H, P), (ring_x.dtype,), dev)
    b, q = x.shape[:2]
    check_int("window", window, 1)
    if not 1 <= q <= window:
        raise ValueError(f"x: q = x.shape[1] = {q} tokens per row must be in [1, window = {window}]")
    if R < window + q:
        raise ValueError(f"ring_x: {R} ring rows < window + q = {window + q}")
    check_tensor("dt", dt, (b, q, H), FLOAT_DTYPES, dev)
    check_tensor("B", B, (b, q, ring_B.shape[1], N), (x.dtype,), dev)
    check_tensor("C", C, tuple(B.shape), (x.dtype,), dev)
    check_params(A, D, dt_bias, H, dev)
    check_indices("state_indices", state_indices, (b,), num_slots, dev, unique=True)
    if dev.type == "cpu":
        used = committed[state_indices[state_indices >= 0].long()]
        if used.numel() and int(used.max()) > window:
            raise ValueError(f"committed: cursors must be <= window = {window}, got {used.tolist()}")
    if out is not None:
        check_tensor("out", out, tuple(x.shape), (x.dtype,), dev)


def replay_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                   state_indices, window: int, *, dt_softplus: bool = True,
                   rand_seed: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """ReplaySSM decode/verify step for q tokens per row; returns y (b, q, H, P) in x.dtype.

    x (b, q, H, P); dt (b, q, H) raw; B, C (b, q, G, N); A, D, dt_bias (H,) fp32;
    state (S, H, P, N); ring_x (S, H, R, P) and ring_B (S, G, R, N) in x.dtype; ring_dt (S, H, R)
    fp32 post-softplus Δ; ring_start, committed (S,) int32 (read only); state_indices (b,) int32,
    -1 = padding (y rows zero, nothing touched); 1 <= q <= window, R >= window + q.
    Mutates: ring rows (o + h + t) mod R of each row's slot (appends), and state[s] iff h + q > W.
    """
    _check_forward(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                   state_indices, window, rand_seed, out)
    rand_seed = resolve_seed(rand_seed, state.device)
    args = (x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
            state_indices, window)
    kwargs = dict(dt_softplus=dt_softplus, rand_seed=rand_seed, out=out)
    return pick_impl("replay", "replay_forward", x, replay_forward_ref)(*args, **kwargs)


def replay_forward_ref(x, dt, A, B, C, D, dt_bias, state, ring_x, ring_B, ring_dt, ring_start, committed,
                       state_indices, window: int, *, dt_softplus: bool = True,
                       rand_seed: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of `replay_forward` (same contract): vectorized over rows, fp32 math."""
    b, q, H, P = x.shape
    W, R = window, ring_x.shape[2]
    if out is None:
        out = torch.empty_like(x)
    out.zero_()  # padding rows must read as zeros
    rows = (state_indices >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    slots = state_indices[rows].long()
    h = committed[slots].long()
    o = ring_start[slots].long()

    # Sequence positions 0..W-1 hold the history (zero-padded past h), W..W+q-1 the new tokens.
    hx, hB, hd = _gather_history(ring_x, ring_B, ring_dt, slots, o, h, W)
    new_delta = softplus_dt(dt[rows], dt_bias, dt_softplus)  # (n, q, H)
    xs = torch.cat([hx, x[rows].float()], dim=1)  # (n, L, H, P)
    Bs = torch.cat([hB, heads_from_groups(B[rows].float(), H)], dim=1)  # (n, L, H, N)
    deltas = torch.cat([hd, new_delta], dim=1)  # (n, L, H)
    Ch = heads_from_groups(C[rows].float(), H)  # (n, q, H, N)
    S0 = state[slots].float()

    lam = torch.cumsum(deltas * A, dim=1)  # Λ_k, (n, L, H)
    lam_t = lam[:, W:]  # Λ at each new token, (n, q, H)
    pos = torch.arange(W + q, device=x.device)
    causal = pos[None, :] <= (W + torch.arange(q, device=x.device))[:, None]  # (q, L)
    diff = (lam_t[:, :, None, :] - lam[:, None, :, :]).clamp_max(0.0)  # (n, q, L, H)
    decay = torch.where(causal[None, :, :, None], torch.exp(diff), 0.0)
    weights = deltas[:, None] * decay * torch.einsum("nthk,nlhk->ntlh", Ch, Bs)
    y = (
        torch.exp(lam_t)[..., None] * torch.einsum("nhpk,nthk->nthp", S0, Ch)
        + torch.einsum("ntlh,nlhp->nthp", weights, xs)
        + D.float()[:, None] * x[rows].float()
    )
    out[rows] = y.to(out.dtype)

    # Append after the history; h + q <= R so appended rows never overlap history rows.
    app = (o[:, None] + h[:, None] + torch.arange(q, device=x.device)) % R  # (n, q)
    ring_x[slots[:, None], :, app] = x[rows]
    ring_B[slots[:, None], :, app] = B[rows]
    ring_dt[slots[:, None], :, app] = new_delta

    # Flush: fold the h history entries (not the new tokens) into the checkpoint.
    flush = (h + q > W).nonzero().squeeze(1)
    if flush.numel():
        S_new = _fold(S0[flush], hx[flush], hB[flush], hd[flush], A)
        store_states(state, slots[flush], S_new, rand_seed)
    return out


def _check_commit(ring_start, committed, state_indices, num_accepted, q, window, ring_rows) -> None:
    check_tensor("committed", committed, (None,), (torch.int32,))
    num_slots, dev = committed.shape[0], committed.device
    check_cursors(ring_start, committed, num_slots, dev)
    check_int("window", window, 1)
    check_int("q", q, 1, window)
    if ring_rows is not None:
        check_int("ring_rows", ring_rows, window + q)
    check_indices("state_indices", state_indices, (None,), num_slots, dev, unique=True)
    check_tensor("num_accepted", num_accepted, tuple(state_indices.shape), (torch.int32,), dev)
    if dev.type == "cpu":
        acc = num_accepted[state_indices >= 0]
        if acc.numel() and (int(acc.min()) < 1 or int(acc.max()) > q):
            raise ValueError(f"num_accepted: values must lie in [1, q = {q}], got {num_accepted.tolist()}")


def replay_commit(ring_start, committed, state_indices, num_accepted, q: int, window: int, *,
                  ring_rows: int | None = None) -> None:
    """Move each row's cursors after sampling, on device (no host sync); padding rows untouched.

    ring_start, committed (S,) int32 (mutated); state_indices (b,) int32; num_accepted (b,) int32
    in [1, q]. With h, o the pre-commit cursors: flushed (h + q > window) -> ring_start = o + h,
    committed = a; else committed = h + a. ring_rows (R) reduces ring_start mod R; readers take
    rows mod R anyway, so without it ring_start just grows (by at most W per flush).
    """
    _check_commit(ring_start, committed, state_indices, num_accepted, q, window, ring_rows)
    args = (ring_start, committed, state_indices, num_accepted, q, window)
    kwargs = {} if ring_rows is None else dict(ring_rows=ring_rows)
    return pick_impl("replay", "replay_commit", committed, replay_commit_ref)(*args, **kwargs)


def replay_commit_ref(ring_start, committed, state_indices, num_accepted, q: int, window: int, *,
                      ring_rows: int | None = None) -> None:
    """PyTorch reference of `replay_commit`; no host sync (padding rows write a scratch entry)."""
    num_slots = committed.shape[0]
    # Padding rows point at an extra scratch entry S, so the scatter needs no data-dependent shape.
    slot = torch.where(state_indices >= 0, state_indices, num_slots).long()
    start_ext = torch.cat([ring_start, ring_start.new_zeros(1)])
    comm_ext = torch.cat([committed, committed.new_zeros(1)])
    h = comm_ext[slot].long()
    o = start_ext[slot].long()
    a = num_accepted.long()
    flushed = h + q > window
    new_start = torch.where(flushed, o + h, o)
    if ring_rows is not None:
        new_start = new_start % ring_rows
    start_ext[slot] = new_start.to(torch.int32)
    comm_ext[slot] = torch.where(flushed, a, h + a).to(torch.int32)
    ring_start.copy_(start_ext[:num_slots])
    committed.copy_(comm_ext[:num_slots])


def _check_materialize(A, state, ring_x, ring_B, ring_dt, ring_start, committed, src_indices,
                       num_entries, dst_indices, rand_seed) -> None:
    _check_cache(state, ring_x, ring_B, ring_dt, ring_start, committed, FLOAT_DTYPES)
    num_slots, H = state.shape[:2]
    dev = state.device
    check_tensor("A", A, (H,), (torch.float32,), dev)
    check_indices("src_indices", src_indices, (None,), num_slots, dev)
    m = src_indices.shape[0]
    check_indices("dst_indices", dst_indices, (m,), num_slots, dev, unique=True)
    check_tensor("num_entries", num_entries, (m,), (torch.int32,), dev)
    if dev.type != "cpu":
        return
    use = (src_indices >= 0) & (dst_indices >= 0)
    src, dst, n = src_indices[use].long(), dst_indices[use], num_entries[use]
    if bool(((n < 0) | (n > committed[src])).any()):
        raise ValueError(f"num_entries: need 0 <= n <= committed[src], got {num_entries.tolist()}")
    if bool(torch.isin(dst, src_indices[use]).any()):
        raise ValueError(f"dst_indices: a destination is also a source, got {dst_indices.tolist()}")


def replay_materialize(A, state, ring_x, ring_B, ring_dt, ring_start, committed, src_indices,
                       num_entries, dst_indices, *, rand_seed: torch.Tensor | None = None) -> None:
    """state[dst] = state[src] advanced by the first n committed ring entries of src (n = 0 copies).

    A (H,) fp32; state, rings and cursors as in `replay_forward`; src_indices, num_entries,
    dst_indices (m,) int32 with 0 <= n <= committed[src]; a row with src or dst = -1 is skipped.
    Never modifies src; ring and cursors of dst are NOT touched (callers reset them).
    """
    _check_materialize(A, state, ring_x, ring_B, ring_dt, ring_start, committed, src_indices,
                       num_entries, dst_indices, rand_seed)
    rand_seed = resolve_seed(rand_seed, state.device)
    args = (A, state, ring_x, ring_B, ring_dt, ring_start, committed, src_indices, num_entries,
            dst_indices)
    impl = pick_impl("replay", "replay_materialize", state, replay_materialize_ref)
    return impl(*args, rand_seed=rand_seed)


def replay_materialize_ref(A, state, ring_x, ring_B, ring_dt, ring_start, committed, src_indices,
                           num_entries, dst_indices, *, rand_seed: torch.Tensor | None = None) -> None:
    """PyTorch reference of `replay_materialize` (same contract)."""
    rows = ((src_indices >= 0) & (dst_indices >= 0)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    src = src_indices[rows].long()
    # Ring length bounds n (n <= committed <= W < R), so no host read of max(n) is needed.
    xs, Bs, ds = _gather_history(ring_x, ring_B, ring_dt, src, ring_start[src].long(),
                                 num_entries[rows].long(), ring_x.shape[2])
    S = _fold(state[src].float(), xs, Bs, ds, A.float())
    store_states(state, dst_indices[rows].long(), S, rand_seed)
