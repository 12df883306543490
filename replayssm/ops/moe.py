"""Routed-expert MLP over token-expert assignments grouped by expert (no host sync on CUDA).

    expert_mlp(x, up_proj, down_proj, group_ends, act) -> h
  x (M, in) the assignments' inputs, grouped by expert (expert 0's rows first); up_proj
  (E, I, in), down_proj (E, in, I) or, for a gated act that halves the width (act(gate) * up
  with up_proj's rows [gate | up]), (E, in, I / 2); group_ends (E,) int: cumulative row counts,
  expert e owns rows [group_ends[e-1], group_ends[e]). Returns h (M, in) in x.dtype with
  h[r] = down_proj[e] @ act(up_proj[e] @ x[r]).

The group sizes depend on the routing, so a per-expert loop must read them on the host every
layer. On CUDA (bf16, Hopper or newer) torch's grouped GEMM takes the ends as a device tensor
and the whole layer stays on the device; elsewhere `expert_mlp_ref` loops over the experts
(one host read of the ends).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _grouped_gemm_ok(x: torch.Tensor, up_proj: torch.Tensor) -> bool:
    if not (x.is_cuda and x.dtype == torch.bfloat16 and up_proj.dtype == torch.bfloat16):
        return False
    if not hasattr(torch, "_grouped_mm"):
        return False
    # The grouped GEMM wants 16-byte aligned rows (8 bf16) in every operand.
    return torch.cuda.get_device_capability(x.device)[0] >= 9 and all(d % 8 == 0 for d in up_proj.shape[1:])


def expert_mlp(x: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor, group_ends: torch.Tensor,
               act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """See the module docstring; dispatches to the device grouped GEMM when it applies."""
    E, I, in_dim = up_proj.shape
    if x.dim() != 2 or x.shape[1] != in_dim:
        raise ValueError(f"x must be (M, {in_dim}), got {tuple(x.shape)}")
    if down_proj.shape not in ((E, in_dim, I), (E, in_dim, I // 2)):
        raise ValueError(f"down_proj must be ({E}, {in_dim}, {I}) or, gated, ({E}, {in_dim}, {I // 2}), "
                         f"got {tuple(down_proj.shape)}")
    if group_ends.shape != (E,):
        raise ValueError(f"group_ends must be ({E},), got {tuple(group_ends.shape)}")
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
