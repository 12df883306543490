"""Causal depthwise conv1d decode update and commit in Triton (twins of `ops/conv1d.py`).

Grid (channel blocks, b): each program owns BLOCK_D channels of one row, reads its K-1
window columns and q inputs into registers, and (commit) writes the new window only after
every read, so src == dst is safe. The varlen prefill stays on the reference (dispatch falls
back to it when this module has no `_varlen_triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 256


@triton.jit
def _tap(win_ptr, x_ptr, k: tl.constexpr, K1: tl.constexpr, cm, wmask, sx_t):
    # Element k of [window (K-1 columns), new inputs]: fp32 (BLOCK_D,).
    if k < K1:
        return tl.load(win_ptr + k, mask=wmask, other=0.0).to(tl.float32)
    else:
        return tl.load(x_ptr + (k - K1) * sx_t, mask=cm, other=0.0).to(tl.float32)


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, bias_ptr, cs_ptr, idx_ptr, y_ptr, Dc,
                        sx_b, sx_t, sy_b, sy_t, scs_s, scs_d,
                        Q: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    pid_d = tl.program_id(0)
    i = tl.program_id(1)
    s = tl.load(idx_ptr + i)
    valid = s >= 0
    c = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = c < Dc
    wmask = cm & ((c * 0 + s) >= 0)
    win_ptr = cs_ptr + tl.maximum(s, 0).to(tl.int64) * scs_s + c * scs_d
    xrow = x_ptr + i * sx_b + c
    for t in tl.static_range(Q):
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            wk = tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)
            acc += wk * _tap(win_ptr, xrow, t + k, K - 1, cm, wmask, sx_t)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        acc = tl.where(valid, acc, 0.0)
        tl.store(y_ptr + i * sy_b + t * sy_t + c, acc.to(y_ptr.dtype.element_ty), mask=cm)


def causal_conv1d_update_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                conv_state: torch.Tensor, state_indices: torch.Tensor,
                                activation: str | None = "silu") -> torch.Tensor:
    """Conv outputs of q new tokens per row from the window (unchanged); API.md `causal_conv1d_update`.

    x (b, q, D); weight (D, K); bias (D,) or None; conv_state (S, D, K-1); state_indices (b,)
    int32, -1 = padding (zero output). Returns y (b, q, D) in x.dtype.
    """
    b, q, Dc = x.shape
    K = weight.shape[1]
    assert x.stride(2) == 1 and conv_state.stride(2) == 1
    weight = weight.contiguous()
    y = torch.empty_like(x)
    if b == 0:
        return y
    _conv_update_kernel[(triton.cdiv(Dc, BLOCK_D), b)](
        x, weight, bias if bias is not None else weight, conv_state, state_indices, y, Dc,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), conv_state.stride(0), conv_state.stride(1),
        Q=q, K=K, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_D=BLOCK_D, num_warps=4,
    )
    return y


@triton.jit
def _conv_commit_kernel(cs_ptr, x_ptr, acc_ptr, idx_ptr, dst_ptr, Dc, q,
                        sx_b, sx_t, scs_s, scs_d,
                        K1: tl.constexpr, KB: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_d = tl.program_id(0)
    i = tl.program_id(1)
    s = tl.load(idx_ptr + i)
    d = tl.load(dst_ptr + i)
    ok = (s >= 0) & (d >= 0)
    a = tl.minimum(tl.maximum(tl.load(acc_ptr + i), 0), q)
    c = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = c < Dc
    k = tl.arange(0, KB)
    km = k < K1
    # New column k is element a + k of [window, x]: a window column or an accepted input.
    pos = a + k
    from_win = pos < K1
    m2 = km[:, None] & (cm & ((c * 0 + tl.where(ok, 1, 0)) > 0))[None, :]
    src = cs_ptr + tl.maximum(s, 0).to(tl.int64) * scs_s + c[None, :] * scs_d
    wv = tl.load(src + pos[:, None], mask=m2 & from_win[:, None], other=0.0)
    xv = tl.load(x_ptr + i * sx_b + (pos - K1)[:, None] * sx_t + c[None, :], mask=m2 & ~from_win[:, None],
                 other=0.0)
    new = tl.where(from_win[:, None], wv, xv.to(wv.dtype))
    dst = cs_ptr + tl.maximum(d, 0).to(tl.int64) * scs_s + c[None, :] * scs_d
    tl.store(dst + k[:, None], new, mask=m2)


def causal_conv1d_commit_triton(conv_state: torch.Tensor, x: torch.Tensor, num_accepted: torch.Tensor,
                                state_indices: torch.Tensor, dst_indices: torch.Tensor | None = None) -> None:
    """window <- last K-1 of [window, x[:a]] into conv_state[dst]; API.md `causal_conv1d_commit`.

    conv_state (S, D, K-1); x (b, q, D); num_accepted (b,) int32 in [0, q]; state_indices (b,)
    int32 (-1 untouched); dst_indices (b,) int32 or None (= state_indices), -1 = skip.
    """
    b, q, Dc = x.shape
    K1 = conv_state.shape[2]
    assert x.stride(2) == 1 and conv_state.stride(2) == 1
    if b == 0 or K1 == 0:
        return
    dst = dst_indices if dst_indices is not None else state_indices
    _conv_commit_kernel[(triton.cdiv(Dc, BLOCK_D), b)](
        conv_state, x, num_accepted, state_indices, dst, Dc, q,
        x.stride(0), x.stride(1), conv_state.stride(0), conv_state.stride(1),
        K1=K1, KB=max(triton.next_power_of_2(K1), 2), BLOCK_D=BLOCK_D, num_warps=4,
    )
