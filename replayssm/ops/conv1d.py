"""Causal depthwise conv1d of the Mamba-2 block: varlen prefill, speculative update, commit.

The window conv_state[s] (D_conv, K-1) holds the last K-1 *committed* conv inputs, oldest
first. Prefill reads it (or zeros), convolves a packed sequence and writes the new window.
A decode/verify step (`causal_conv1d_update`) convolves q new tokens against the window
without touching it; after sampling, `causal_conv1d_commit` moves the window to end at the
last accepted token:

    window  w0 w1 w2 | new x0 x1 x2 x3      (K = 4, q = 4, a = 2 accepted)
    commit  ->  w2 x0 x1                    (last K-1 of [window, x[:a]])

Plain decoding accepts every token it computes (q = 1, a = 1), so there the update can move
the window itself (`advance_window=True`) and the separate commit is skipped.

Each public op validates its arguments and runs the Triton kernel
(`replayssm/ops/triton/conv1d.py`) for CUDA tensors when it imports, else the `_ref` twin.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from replayssm.ops._checks import FLOAT_DTYPES, check_indices, check_tensor
from replayssm.ops.common import pick_impl
from replayssm.ops.conv_layout import varlen_conv_layout

_ACTIVATIONS = ("silu", None)


def _conv_taps(
    ext: Tensor, starts: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None
) -> Tensor:
    """y[t] = act(sum_k weight[:, k] * ext[starts[t] + k] + bias) in fp32.

    ext (L, D) fp32 inputs with their windows laid out in front; starts (T,) int64.
    """
    w = weight.float()
    y = torch.zeros(starts.shape[0], ext.shape[1], dtype=torch.float32, device=ext.device)
    for k in range(w.shape[1]):  # K is 2..4: one vectorized gather per tap
        y += ext[starts + k] * w[:, k]
    if bias is not None:
        y += bias.float()
    return F.silu(y) if activation == "silu" else y


def _check_conv(
    x: Tensor, ndim: int, weight: Tensor, bias: Tensor | None, conv_state: Tensor, activation: str | None
) -> None:
    check_tensor("x", x, (None,) * ndim, FLOAT_DTYPES)
    D = x.shape[-1]
    check_tensor("weight", weight, (D, None), FLOAT_DTYPES, x.device)
    if bias is not None:
        check_tensor("bias", bias, (D,), FLOAT_DTYPES, x.device)
    K = weight.shape[1]
    if K < 1:
        raise ValueError(f"weight: kernel width must be >= 1, got {K}")
    check_tensor("conv_state", conv_state, (None, D, K - 1), FLOAT_DTYPES, x.device)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def _check_window_layout(conv_state: Tensor) -> None:
    """The Triton update and commit read and write window columns at unit stride."""
    if conv_state.is_cuda and conv_state.numel() and conv_state.stride(2) != 1:
        raise ValueError(f"conv_state: the last dimension must be contiguous, got strides "
                         f"{conv_state.stride()}")


def causal_conv1d_varlen_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """Reference of `causal_conv1d_varlen` (same signature), vectorized over all tokens.

    Reads its metadata on the host once per set of metadata tensors (ops/conv_layout.py): the layers
    of one forward pass share it, and nothing here waits for the device.
    """
    T, D = x.shape
    K = weight.shape[1]
    lay = varlen_conv_layout(cu_seqlens, state_indices, has_initial_state, K, T)
    # ext: each sequence's initial window (zeros without one) in front of its tokens.
    ext = torch.zeros(lay.rows, D, dtype=torch.float32, device=x.device)
    ext[lay.token_row] = x.float()
    if lay.init_mode != "none":
        init = conv_state[lay.read_slots].float().transpose(1, 2)  # (n, K-1, D)
        if lay.use_init is not None:
            init = torch.where(lay.use_init, init, 0.0)
        ext[lay.window_rows] = init.reshape(-1, D)
    w = weight.float()
    y = ext[lay.taps[0]] * w[:, 0]
    for k in range(1, K):  # K is 2..4: one gather per tap
        y += ext[lay.taps[k]] * w[:, k]
    if bias is not None:
        y += bias.float()
    if activation == "silu":
        y = F.silu(y)
    if lay.token_valid is not None:  # padding sequences output zeros
        y = torch.where(lay.token_valid, y, 0.0)
    # Final window: the last K-1 rows of each extended sequence (history when it is short).
    final = ext[lay.final_rows].view(lay.store_slots.shape[0], K - 1, D).transpose(1, 2)
    conv_state[lay.store_slots] = final.to(conv_state.dtype)
    return y.to(x.dtype)


def causal_conv1d_varlen(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    cu_seqlens: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """Causal conv over packed sequences, reading and writing each sequence's window.

    x (T, D_conv); weight (D_conv, K); bias (D_conv,) or None; conv_state (S, D_conv, K-1);
    cu_seqlens (n+1,) int32; state_indices (n,) int32 (-1 = padding sequence: no read, no
    write, zero output); has_initial_state (n,) bool (False: the window starts as zeros).
    Writes the last K-1 inputs (window included when the sequence is shorter) to
    conv_state[s]. Returns y (T, D_conv) in x.dtype.
    """
    _check_conv(x, 2, weight, bias, conv_state, activation)
    check_tensor("cu_seqlens", cu_seqlens, (None,), (torch.int32,), x.device)
    n = cu_seqlens.shape[0] - 1
    if n < 0:
        raise ValueError("cu_seqlens: needs at least one entry")
    check_indices("state_indices", state_indices, (n,), conv_state.shape[0], x.device, unique=True)
    check_tensor("has_initial_state", has_initial_state, (n,), (torch.bool,), x.device)
    if cu_seqlens.device.type == "cpu":
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != x.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens: must rise from 0 to T={x.shape[0]}, got {cu}")
    fn = pick_impl("conv1d", "causal_conv1d_varlen", x, causal_conv1d_varlen_ref)
    return fn(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state, activation)


def _windows_then_new(x: Tensor, conv_state: Tensor, slots: Tensor) -> Tensor:
    """(b, K-1+q, D) fp32: each row's window (zeros for padding rows) followed by its q inputs."""
    win = conv_state[slots.clamp(min=0)].float().transpose(1, 2)
    win = torch.where((slots >= 0)[:, None, None], win, 0.0)
    return torch.cat([win, x.float()], dim=1)


def causal_conv1d_update_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    state_indices: Tensor,
    activation: str | None = "silu",
    *,
    outs: Sequence[Tensor] | None = None,
    inputs_out: Tensor | None = None,
    advance_window: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """Reference of `causal_conv1d_update` (same signature), vectorized over rows and tokens."""
    b, q, D = x.shape
    K = weight.shape[1]
    slots = state_indices.long()
    ext = _windows_then_new(x, conv_state, slots)  # (b, K-1+q, D), read before the window moves
    starts = (torch.arange(b, device=x.device) * (K - 1 + q))[:, None] + torch.arange(q, device=x.device)
    y = _conv_taps(ext.reshape(-1, D), starts.reshape(-1), weight, bias, activation).view(b, q, D)
    y = torch.where((slots >= 0)[:, None, None], y, 0.0).to(x.dtype)
    if advance_window:
        live = slots >= 0
        conv_state[slots[live]] = ext[live, q:].transpose(1, 2).to(conv_state.dtype)
    if inputs_out is not None:
        inputs_out.copy_(x)
    if outs is None:
        return y
    for o, part in zip(outs, y.split([o.shape[2] for o in outs], dim=2)):
        o.copy_(part)
    return tuple(outs)


def causal_conv1d_update(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    state_indices: Tensor,
    activation: str | None = "silu",
    *,
    outs: Sequence[Tensor] | None = None,
    inputs_out: Tensor | None = None,
    advance_window: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """Conv outputs of q new tokens per row from the committed window; the window is NOT changed
    unless advance_window.

    x (b, q, D_conv), any strides (a column slice of a projection is read in place); weight
    (D_conv, K); bias (D_conv,) or None; conv_state (S, D_conv, K-1); state_indices (b,) int32,
    -1 = padding row (zero output). Returns y (b, q, D_conv) in x.dtype.
    outs: up to three (b, q, D_i) tensors of x.dtype, last dim contiguous, sum D_i = D_conv: y's
    channels are written into them in order (x | B | C of a Mamba layer, no split copies) and they
    are returned instead. inputs_out: (b, q, D_conv) x.dtype, last dim contiguous, receives x.
    advance_window: also commit all q tokens (= `causal_conv1d_commit` with a = q) in the same
    pass, every read before any write: window <- last K-1 of [window, x] for each live row; the
    live slots must then be distinct.
    """
    _check_conv(x, 3, weight, bias, conv_state, activation)
    _check_window_layout(conv_state)
    check_indices("state_indices", state_indices, (x.shape[0],), conv_state.shape[0], x.device,
                  unique=advance_window)
    b, q, D = x.shape
    if outs is not None:
        outs = tuple(outs)
        if not 1 <= len(outs) <= 3:
            raise ValueError(f"outs: expected 1 to 3 tensors, got {len(outs)}")
        for i, o in enumerate(outs):
            check_tensor(f"outs[{i}]", o, (b, q, None), (x.dtype,), x.device)
            if o.stride(2) != 1:
                raise ValueError(f"outs[{i}]: the last dimension must be contiguous")
        if sum(o.shape[2] for o in outs) != D:
            raise ValueError(f"outs: widths {[o.shape[2] for o in outs]} must add up to D_conv = {D}")
    if inputs_out is not None:
        check_tensor("inputs_out", inputs_out, (b, q, D), (x.dtype,), x.device)
        if inputs_out.stride(2) != 1:
            raise ValueError("inputs_out: the last dimension must be contiguous")
    fn = pick_impl("conv1d", "causal_conv1d_update", x, causal_conv1d_update_ref)
    return fn(x, weight, bias, conv_state, state_indices, activation, outs=outs, inputs_out=inputs_out,
              advance_window=advance_window)


def causal_conv1d_commit_ref(
    conv_state: Tensor,
    x: Tensor,
    num_accepted: Tensor,
    state_indices: Tensor,
    dst_indices: Tensor | None = None,
) -> None:
    """Reference of `causal_conv1d_commit` (same signature)."""
    b, q, D = x.shape
    K1 = conv_state.shape[2]
    src = state_indices.long()
    dst = src if dst_indices is None else dst_indices.long()
    ext = _windows_then_new(x, conv_state, src)  # every read happens before any write
    # Padding rows may carry any count: clamp so their (discarded) gather stays in range.
    pos = num_accepted.long().clamp(0, q)[:, None] + torch.arange(K1, device=x.device)  # (b, K-1)
    new = torch.gather(ext, 1, pos[:, :, None].expand(b, K1, D)).transpose(1, 2)
    keep = (src >= 0) & (dst >= 0)
    conv_state[dst[keep]] = new[keep].to(conv_state.dtype)


def causal_conv1d_commit(
    conv_state: Tensor,
    x: Tensor,
    num_accepted: Tensor,
    state_indices: Tensor,
    dst_indices: Tensor | None = None,
) -> None:
    """Move each row's window to end at its last accepted token.

    conv_state (S, D_conv, K-1); x (b, q, D_conv) the conv inputs of the step; num_accepted
    (b,) int32 in [0, q] (0 keeps the window); state_indices (b,) int32, -1 = padding row
    (untouched); dst_indices (b,) int32 or None (= state_indices), -1 = skip. Writes
    window <- last K-1 of [window, x[:a]] to conv_state[dst]; all reads precede all writes.
    """
    check_tensor("x", x, (None, None, None), FLOAT_DTYPES)
    b, q, D = x.shape
    check_tensor("conv_state", conv_state, (None, D, None), FLOAT_DTYPES, x.device)
    _check_window_layout(conv_state)
    S = conv_state.shape[0]
    check_indices("state_indices", state_indices, (b,), S, x.device)
    if dst_indices is not None:
        check_indices("dst_indices", dst_indices, (b,), S, x.device, unique=True)
    else:
        check_indices("state_indices", state_indices, (b,), S, x.device, unique=True)
    check_tensor("num_accepted", num_accepted, (b,), (torch.int32,), x.device)
    if num_accepted.device.type == "cpu":
        live = num_accepted[state_indices >= 0]
        if live.numel() and (int(live.min()) < 0 or int(live.max()) > q):
            raise ValueError(f"num_accepted: values must lie in [0, {q}], got {num_accepted.tolist()}")
    fn = pick_impl("conv1d", "causal_conv1d_commit", x, causal_conv1d_commit_ref)
    fn(conv_state, x, num_accepted, state_indices, dst_indices)


def causal_conv1d_commit_layers(
    conv_states: list[Tensor],
    xs: list[Tensor],
    num_accepted: Tensor,
    state_indices: Tensor,
    dst_indices: Tensor | None = None,
) -> None:
    """`causal_conv1d_commit(conv_states[l], xs[l], ...)` for every layer l, same indices for all.

    The checks depend only on shapes, dtypes, devices and the shared index tensors, so they run
    once per distinct (conv_state, x) layout instead of once per layer (all layers of a model
    usually share one); every layer still gets exactly the public op's validation.
    """
    if len(conv_states) != len(xs):
        raise ValueError(f"conv_states has {len(conv_states)} layers, xs has {len(xs)}")
    checked = set()
    for conv_state, x in zip(conv_states, xs):
        key = None
        if isinstance(conv_state, Tensor) and isinstance(x, Tensor):
            key = (tuple(conv_state.shape), conv_state.dtype, conv_state.device,
                   tuple(x.shape), x.dtype, x.device)
        if key is None or key not in checked:
            causal_conv1d_commit(conv_state, x, num_accepted, state_indices, dst_indices)
            checked.add(key)
            continue
        fn = pick_impl("conv1d", "causal_conv1d_commit", x, causal_conv1d_commit_ref)
        fn(conv_state, x, num_accepted, state_indices, dst_indices)
