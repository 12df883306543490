"""Dense MLP (non-gated, relu2 in Nemotron-H) and the Nemotron-H mixture of experts.

The MoE mirrors transformers' Nemotron-H exactly: sigmoid router scores in fp32, expert choice
on scores + e_score_correction_bias restricted to the best `topk_group` of `n_group` groups
(a group scores as the sum of its two best experts), weights from the uncorrected scores,
optionally normalized, times `routed_scaling_factor`; routed experts are up -> act -> down
with no gate; shared experts see the block input; an optional latent projection wraps the
routed experts only. Granite's routing (`SoftmaxTopkRouter`) and gated experts
(`Experts(gated_act=True)`) are here too; its MoE block is in models/two_part.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayssm.models.config import ModelConfig
from replayssm.ops.activation import relu2
from replayssm.ops.fp8 import FP8_DTYPE, dequantize_fp8
from replayssm.ops.moe import expert_mlp, expert_mlp_fp8, fp8_experts_path

ACTIVATIONS = {"relu2": relu2, "silu": F.silu, "gelu": F.gelu}


class MLP(nn.Module):
    """down(act(up(x))); x (T, hidden) -> (T, hidden)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool, *,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class TopkRouter(nn.Module):
    """Grouped top-k over sigmoid scores; weight and correction bias stay fp32 (as in the checkpoint)."""

    def __init__(self, cfg: ModelConfig, *, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device))
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts, device=device))
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, k) fp32, expert ids (T, k) int64)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        T, E = choice.shape
        group_scores = choice.view(T, self.n_group, E // self.n_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(T, self.n_group, E // self.n_group).reshape(T, E)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class SoftmaxTopkRouter(nn.Module):
    """Granite: the k largest router logits (fp32 from the model-dtype product), softmax over those k,
    weights rounded to the model dtype as transformers does."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device, dtype=dtype))
        self.top_k = cfg.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, k), expert ids (T, k) int64)."""
        logits = F.linear(x, self.weight).float()
        top, ids = logits.topk(self.top_k, dim=-1)
        return top.softmax(dim=-1).to(x.dtype), ids


def gated(act):
    """act(gate) * up for h = [gate | up] along the last dimension."""
    def gated_act(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return act(gate) * up
    return gated_act


class Experts(nn.Module):
    """Routed experts as stacked weights: up_proj (E, I, in), down_proj (E, in, I).

    gated_act: up_proj (E, 2I, in) holds rows [gate | up] and the expert computes act(gate) * up
    (Granite's input_linear). FP8 experts (layers/fp8_linear.py) hold E4M3 stacks with
    `up_proj_scale` / `down_proj_scale` and `fp8_activation` (the checkpoint's activation scheme);
    `fp8_experts_path` (ops/moe.py) picks the FP8 grouped GEMM with per-token activation scales
    (also for checkpoints with static input scales, which the experts do not read) or the grouped
    GEMM on the stacks dequantized to x.dtype.
    """

    def __init__(self, num_experts: int, in_dim: int, intermediate: int, act: str, *,
                 gated_act: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        rows = 2 * intermediate if gated_act else intermediate
        self.up_proj = nn.Parameter(torch.empty(num_experts, rows, in_dim, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, in_dim, intermediate, **kw))
        self.act = gated(ACTIVATIONS[act]) if gated_act else ACTIVATIONS[act]
        self.gated = gated_act
        self.register_parameter("up_proj_scale", None)
        self.register_parameter("down_proj_scale", None)
        self.fp8_activation = "none"  # set by apply_fp8 for E4M3 stacks

    def expert_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(up_proj, down_proj) as the expert GEMM takes them: FP8 stacks dequantized to `dtype`."""
        up, down = self.up_proj, self.down_proj
        if up.dtype == FP8_DTYPE:
            up = dequantize_fp8(up, self.up_proj_scale, dtype)
        if down.dtype == FP8_DTYPE:
            down = dequantize_fp8(down, self.down_proj_scale, dtype)
        return up, down

    def _expert_mlp(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The grouped expert MLP over rows x grouped by expert (ends: device-side group ends)."""
        up, down = self.up_proj, self.down_proj
        if (up.dtype == FP8_DTYPE and down.dtype == FP8_DTYPE
                and fp8_experts_path(x, up, down, self.fp8_activation) == "scaled_grouped_mm"):
            return expert_mlp_fp8(x, up, self.up_proj_scale, down, self.down_proj_scale, ends, self.act)
        up, down = self.expert_weights(x.dtype)
        return expert_mlp(x, up, down, ends, self.act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, in); weights, ids (T, k). Weighted sum over each token's experts, accumulated in fp32.

        Static shapes and no host read (on CUDA): the T*k assignments are grouped by expert
        with device-side group ends, run through one grouped expert MLP, and summed per token
        in ascending expert order (the order an expert-by-expert loop adds them in).
        """
        T, k = ids.shape
        num_experts = self.up_proj.shape[0]
        ids, perm = ids.sort(dim=1)
        weights = weights.gather(1, perm)
        flat = ids.flatten()
        # Stable: within one expert the tokens stay in ascending order.
        order = torch.argsort(flat, stable=True)
        # scatter_add, not bincount: CUDA bincount reads the max id back to size its output.
        counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
        ends = torch.cumsum(counts.scatter_add_(0, flat, torch.ones_like(flat)), 0)
        h = self._expert_mlp(x[order // k], ends)
        h = h * weights.flatten()[order, None]  # fp32 from here on
        per_slot = torch.empty_like(h)
        per_slot[order] = h
        per_slot = per_slot.view(T, k, -1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for j in range(k):
            out += per_slot[:, j]
        return out.to(x.dtype)


class MoE(nn.Module):
    """Nemotron-H MoE block: routed experts (+ optional latent projection) + shared experts."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        in_dim = cfg.moe_latent_size or cfg.hidden_size
        self.gate = TopkRouter(cfg, device=device)
        self.experts = Experts(cfg.num_experts, in_dim, cfg.moe_intermediate_size, cfg.mlp_act,
                               device=device, dtype=dtype)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_intermediate_size, cfg.mlp_act,
                                  cfg.mlp_bias, device=device, dtype=dtype)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if cfg.moe_latent_size is not None:
            kw = dict(bias=cfg.mlp_bias, device=device, dtype=dtype)
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, **kw)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        weights, ids = self.gate(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        h = self.experts(h, weights, ids)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)
