"""Float64 per-token Mamba-2 recurrence: the oracle every SSM op is checked against.

Works on one sequence at a time, in float64 on the CPU, with no vectorization tricks, so it
is easy to believe. Shapes follow shared/DESIGN.md §1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Δ = softplus(dt + dt_bias), identity above 20, in float64."""
    v = dt.double() + dt_bias.double()
    return torch.where(v > 20.0, v, F.softplus(v))


def ssm_recurrence(
    state0: torch.Tensor,  # (H, P, N) initial state
    x: torch.Tensor,  # (L, H, P)
    delta: torch.Tensor,  # (L, H) post-softplus Δ
    A: torch.Tensor,  # (H,) negative
    B: torch.Tensor,  # (L, G, N)
    C: torch.Tensor,  # (L, G, N)
    D: torch.Tensor,  # (H,)
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Run S_t = exp(Δ_t A) S_{t-1} + Δ_t x_t B_tᵀ ; y_t = S_t C_t + D x_t token by token.

    Returns (y (L, H, P), final state (H, P, N), states after each token), all float64.
    """
    S = state0.double().clone()
    H = S.shape[0]
    G = B.shape[1]
    group = torch.arange(H) // (H // G)
    ys, states = [], []
    for t in range(x.shape[0]):
        d = delta[t].double()  # (H,)
        Bt = B[t].double()[group]  # (H, N)
        Ct = C[t].double()[group]
        xt = x[t].double()  # (H, P)
        S = torch.exp(d * A.double())[:, None, None] * S + d[:, None, None] * xt[:, :, None] * Bt[:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", S, Ct) + D.double()[:, None] * xt)
        states.append(S.clone())
    y = torch.stack(ys) if ys else x.new_zeros((0,) + tuple(x.shape[1:]), dtype=torch.float64)
    return y, S, states


def conv1d_recurrence(
    window: torch.Tensor,  # (D, K-1) previous inputs, oldest first
    x: torch.Tensor,  # (L, D)
    weight: torch.Tensor,  # (D, K)
    bias: torch.Tensor | None,  # (D,)
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv token by token in float64. Returns (y (L, D), final window (D, K-1))."""
    win = window.double().clone()
    K = weight.shape[1]
    ys = []
    for t in range(x.shape[0]):
        full = torch.cat([win, x[t].double()[:, None]], dim=1)  # (D, K)
        y = (full * weight.double()).sum(1)
        if bias is not None:
            y = y + bias.double()
        if activation == "silu":
            y = F.silu(y)
        ys.append(y)
        win = full[:, 1:] if K > 1 else full[:, :0]
    y = torch.stack(ys) if ys else x.new_zeros((0, x.shape[1]), dtype=torch.float64)
    return y, win
