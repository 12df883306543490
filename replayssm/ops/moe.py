"""Routed-expert MLP over token-expert assignments grouped by expert (no host sync on CUDA).

    expert_mlp(x, up_proj, down_proj, group_ends, act) -> h
  x (M, in) the assignments' inputs, grouped by expert (expert 0's rows first); up_proj
  (E, I, in), down_proj (E, in, I) or, for a gated act that halves the width (act(gate) * up
  with up_proj's rows [gate | up]), (E, in, I / 2); group_ends (E,) int: cumulative row counts,
  expert e owns rows [group_ends[e-1], group_ends[e]). Returns h (M, in) in x.dtype with
  h[r] = down_proj[e] @ act(up_proj[e] @ x[r]).

    expert_mlp_fp8(x, up_q, up_scale, down_q, down_scale, group_ends, act) -> h
  The same MLP with E4M3 expert stacks up_q, down_q and fp32 scales (E, N, 1) per channel or
  (E, 1, 1) per expert (ops/fp8.py). Activations are quantized per token (dynamic scales, one per
  row of x and of act(h)), so h[r] = down_e @ act(up_e @ x[r]) with both operands in E4M3 and the
  products accumulated in fp32.

The group sizes depend on the routing, so a per-expert loop must read them on the host every
layer. On CUDA (bf16, Hopper or newer) torch's grouped GEMM takes the ends as a device tensor
and the whole layer stays on the device; elsewhere `expert_mlp_ref` loops over the experts
(one host read of the ends). FP8 experts take `torch._scaled_grouped_mm` (FP8 tensor cores, the
same device-side ends) where `fp8_experts_path` allows it, and otherwise run `expert_mlp` on the
stacks dequantized to x.dtype (models/layers/mlp.py). `expert_mlp_fp8_ref` is the slow twin of
the FP8 path: the same quantized operands, per expert, in fp32.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from replayssm.ops.fp8 import FP8_DTYPE, quantize_per_token, scale_rows

logger = logging.getLogger(__name__)


def _grouped_gemm_ok(x: torch.Tensor, up_proj: torch.Tensor) -> bool:
    if not (x.is_cuda and x.dtype == torch.bfloat16 and up_proj.dtype == torch.bfloat16):
        return False
    if not hasattr(torch, "_grouped_mm"):
        return False
    # The grouped GEMM wants 16-byte aligned rows (8 bf16) in every operand.
    return torch.cuda.get_device_capability(x.device)[0] >= 9 and all(d % 8 == 0 for d in up_proj.shape[1:])


def _check_shapes(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, group_ends: torch.Tensor,
                  down_name: str) -> None:
    """ValueError naming the argument unless x (M, in), up (E, I, in), down (E, in, I or I / 2 gated) and
    group_ends (E,) agree (bf16 and FP8 experts alike)."""
    E, I, in_dim = up.shape
    if x.dim() != 2 or x.shape[1] != in_dim:
        raise ValueError(f"x must be (M, {in_dim}), got {tuple(x.shape)}")
    if down.shape not in ((E, in_dim, I), (E, in_dim, I // 2)):
        raise ValueError(f"{down_name} must be ({E}, {in_dim}, {I}) or, gated, ({E}, {in_dim}, {I // 2}), "
                         f"got {tuple(down.shape)}")
    if group_ends.shape != (E,):
        raise ValueError(f"group_ends must be ({E},), got {tuple(group_ends.shape)}")


def expert_mlp(x: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor, group_ends: torch.Tensor,
               act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """See the module docstring; dispatches to the device grouped GEMM when it applies."""
    _check_shapes(x, up_proj, down_proj, group_ends, "down_proj")
    if _grouped_gemm_ok(x, up_proj) and down_proj.shape[-1] % 8 == 0:
        ends = group_ends.to(torch.int32)
        h = torch._grouped_mm(x, up_proj.transpose(-2, -1), offs=ends)
        return torch._grouped_mm(act(h), down_proj.transpose(-2, -1), offs=ends)
    return expert_mlp_ref(x, up_proj, down_proj, group_ends, act)


def expert_mlp_ref(x: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor, group_ends: torch.Tensor,
                   act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per-expert loop (reads group_ends on the host once)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(group_ends.tolist()):
        if end > start:
            h = act(F.linear(x[start:end], up_proj[e]))
            out[start:end] = F.linear(h, down_proj[e])
        start = end
    return out


def fp8_experts_path(x: torch.Tensor, up_q: torch.Tensor, down_q: torch.Tensor, activation: str) -> str:
    """Which kernel runs FP8 experts: "scaled_grouped_mm", or "dequant" (expert_mlp on dequantized stacks)."""
    if not x.is_cuda:
        return "dequant"  # CPU: no FP8 GEMM; the dequantized stacks are the exact reference
    if activation == "none":
        return "dequant"  # weight-only checkpoint: the activations stay in the model dtype
    if x.dtype != torch.bfloat16:
        return "dequant"  # the scaled grouped GEMM writes bf16 only
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "dequant"  # row-wise scaled grouped GEMM needs Hopper or newer
    if not hasattr(torch, "_scaled_grouped_mm"):
        return "dequant"  # this torch has no FP8 grouped GEMM
    if any(d % 16 for d in (*up_q.shape[1:], *down_q.shape[1:])):
        return "dequant"  # FP8 operands need 16-byte aligned rows: every N and K a multiple of 16
    if _scaled_grouped_mm_works.cache_info().currsize == 0 and torch.cuda.is_current_stream_capturing():
        return "dequant"  # unprobed inside a graph capture, where the probe cannot synchronize
    if not _scaled_grouped_mm_works(x.device):
        return "dequant"  # the op exists but failed its probe on this GPU (logged once)
    return "scaled_grouped_mm"


@functools.cache
def _scaled_grouped_mm_works(device: torch.device) -> bool:
    """One tiny call of the op, checked against its reference (cached per device; fp8_experts_path calls it
    outside graph capture: the engine's eager warm-up steps run first)."""
    E, K, N = 2, 32, 16
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(5, K, device=device, generator=g, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=device, generator=g).to(FP8_DTYPE)
    scale = torch.rand(E, N, 1, device=device, generator=g) + 0.5
    ends = torch.tensor([2, 5], device=device)
    try:
        got = _scaled_grouped_gemm(x, w, scale, ends.to(torch.int32))
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        logger.warning("torch._scaled_grouped_mm fails on %s (%s); FP8 experts run dequantized", device, e)
        return False
    xq, xs = quantize_per_token(x)
    want = torch.cat([(xq[a:b].float() * xs[a:b]) @ (w[e].float() * scale[e]).T
                      for e, (a, b) in enumerate([(0, 2), (2, 5)])])
    ok = bool(((got.float() - want).norm() <= 1e-2 * want.norm()).item())
    if not ok:
        logger.warning("torch._scaled_grouped_mm disagrees with its reference on %s; FP8 experts run "
                       "dequantized", device)
    return ok


def _scaled_grouped_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                         ends: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16 -> (M, N) bf16: row r of group e is x[r] @ (w_q[e] * w_scale[e]).T (x per-token E4M3).

    `_scaled_grouped_mm` wants the (E, K, N) operand column-major (w_q (E, N, K) row-major transposed),
    scale_a (M,) one per row of x and scale_b (E, N) one per expert and output channel, both fp32 and
    dense (`scale_rows`: a view of a per-channel scale, a per-expert one expanded once)."""
    E, N, _ = w_q.shape
    xq, x_scale = quantize_per_token(x)
    return torch._scaled_grouped_mm(xq, w_q.transpose(-2, -1), x_scale.reshape(-1), scale_rows(w_scale, N),
                                    offs=ends, out_dtype=torch.bfloat16)


def _check_fp8(x, up_q, up_scale, down_q, down_scale, group_ends) -> None:
    assert up_q.dtype == FP8_DTYPE and down_q.dtype == FP8_DTYPE, (up_q.dtype, down_q.dtype)
    _check_shapes(x, up_q, down_q, group_ends, "down_q")
    E, I, in_dim = up_q.shape
    for name, scale, rows in (("up_scale", up_scale, I), ("down_scale", down_scale, in_dim)):
        if scale.shape not in ((E, rows, 1), (E, 1, 1)):
            raise ValueError(f"{name} must be ({E}, {rows}, 1) or ({E}, 1, 1), got {tuple(scale.shape)}")


def expert_mlp_fp8(x: torch.Tensor, up_q: torch.Tensor, up_scale: torch.Tensor, down_q: torch.Tensor,
                   down_scale: torch.Tensor, group_ends: torch.Tensor,
                   act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """See the module docstring: two scaled grouped GEMMs on the device (callers check fp8_experts_path)."""
    _check_fp8(x, up_q, up_scale, down_q, down_scale, group_ends)
    ends = group_ends.to(torch.int32)
    h = _scaled_grouped_gemm(x, up_q, up_scale, ends)
    return _scaled_grouped_gemm(act(h), down_q, down_scale, ends)


def expert_mlp_fp8_ref(x: torch.Tensor, up_q: torch.Tensor, up_scale: torch.Tensor, down_q: torch.Tensor,
                       down_scale: torch.Tensor, group_ends: torch.Tensor,
                       act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per-expert loop with the FP8 path's operands: per-token E4M3 activations times the E4M3 weights,
    products and scales in fp32, each GEMM's output rounded once to x.dtype (one host read of the ends)."""
    _check_fp8(x, up_q, up_scale, down_q, down_scale, group_ends)

    def gemm(a: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        aq, a_scale = quantize_per_token(a)
        return ((aq.float() @ w_q.float().T) * a_scale * w_scale.reshape(1, -1)).to(x.dtype)

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(group_ends.tolist()):
        if end > start:
            h = act(gemm(x[start:end], up_q[e], up_scale[e]))
            out[start:end] = gemm(h, down_q[e], down_scale[e])
        start = end
    return out
