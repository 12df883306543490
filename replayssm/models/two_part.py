"""Two-part hybrid decoders (Granite 4.0-H, Bamba): each layer is a mixer sub-block, then a feed-forward one.

    h = embed(ids) * embedding_multiplier
    per layer i:  h = h + residual_multiplier * mixer(input_layernorm(h))     Mamba-2 or attention
                  h = h + residual_multiplier * ffn(post_attention_layernorm(h))
    logits = lm_head(norm_f(h)) / logits_scaling

Granite's ffn is its shared gated MLP, plus the routed experts (softmax top-k router) when the
config has any; its attention has no positional encoding and takes attention_multiplier as its
softmax scale. Bamba's ffn is a SwiGLU MLP (separate gate_proj and up_proj), its attention
applies partial RoPE (ModelConfig.rotary_dim), and its multipliers are all 1. The two families
share the Mamba-2 mixer exactly (transformers' Bamba and Granite mixers are the same code,
gated norm per group of I / G channels). Norms cast before the weight, as both families' do.

The engine sees the same interface as models/hybrid.py: `layers[i].kind` and `.mixer` (the
Mamba-2 mixers own the caches and ReplaySSM, unchanged), `compute_logits`. Our module names
follow Granite's checkpoint except the mixer (`mamba` / `self_attn` -> `mixer`), the dense MLP
(`shared_mlp` / Bamba's `feed_forward` -> `mlp`) and the top level (`embed_tokens` ->
`embeddings`, `norm` / Bamba's `final_layernorm` -> `norm_f`); Bamba's `pre_ff_layernorm` is our
`post_attention_layernorm`. `checkpoint_name` maps both families' names (they never collide).
Under tensor parallelism every sub-block holds its rank's shard (distributed/sharding.py: mixers by
heads, the dense MLP and each routed expert by their intermediate dimension, the router replicated)
and the block all-reduces each sub-block's output once (MLP and experts share one all-reduce).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from replayssm.distributed.parallel import SINGLE, TensorParallel
from replayssm.distributed.sharding import local_config
from replayssm.models.config import ATTENTION, MAMBA, MOE, ModelConfig
from replayssm.models.config_two_part import GRANITE
from replayssm.models.hybrid import DecoderLM
from replayssm.models.layers.attention import Attention
from replayssm.models.layers.mamba2 import Mamba2Mixer
from replayssm.models.layers.mlp import ACTIVATIONS, Experts, SoftmaxTopkRouter
from replayssm.models.layers.norm import RMSNorm
from replayssm.models.layers.rotary import rotary_for

# Checkpoint name (after the `model.` prefix) -> ours; the first matching rule applies, once.
_RENAMES = (
    (re.compile(r"^embed_tokens\."), "embeddings."),
    (re.compile(r"^(?:norm|final_layernorm)\."), "norm_f."),
    (re.compile(r"^(layers\.\d+)\.(?:mamba|self_attn)\."), r"\1.mixer."),
    (re.compile(r"^(layers\.\d+)\.(?:shared_mlp|feed_forward)\."), r"\1.mlp."),
    (re.compile(r"^(layers\.\d+)\.pre_ff_layernorm\."), r"\1.post_attention_layernorm."),
    # Granite's published MoE names, and the ones transformers 5 uses in memory.
    (re.compile(r"\.block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj)$"),
     ".block_sparse_moe.experts.up_proj"),
    (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".block_sparse_moe.experts.down_proj"),
    (re.compile(r"\.block_sparse_moe\.router\.layer\.weight$"), ".block_sparse_moe.router.weight"),
)


def checkpoint_name(key: str) -> str:
    """Checkpoint tensor name -> our parameter name."""
    key = key.removeprefix("model.")
    for pattern, repl in _RENAMES:
        new, n = pattern.subn(repl, key)
        if n:
            return new
    return key


class GatedMLP(nn.Module):
    """Granite's shared MLP: output_linear(act(gate) * up), input_linear's rows [gate | up]."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, *, device=None,
                 dtype=None) -> None:
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, **kw)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, **kw)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class SwiGLU(nn.Module):
    """Bamba's MLP: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, *, device=None,
                 dtype=None) -> None:
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GraniteMoE(nn.Module):
    """Routed experts of one Granite layer (the shared MLP is the block's `mlp`)."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.router = SoftmaxTopkRouter(cfg, device=device, dtype=dtype)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.mlp_act,
                               gated_act=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class TwoPartBlock(nn.Module):
    """h <- h + m * mixer(norm(h)); h <- h + m * ffn(norm(h)) (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, kind: str, ffn_kind: str, index_of_kind: int, *, device=None,
                 dtype=None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.kind = kind
        self.tp = tp
        self.residual_multiplier = cfg.residual_multiplier
        local = local_config(cfg, tp.size)  # head and intermediate counts of this rank's shard
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=True, **kw)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg, index_of_kind, tp=tp, **kw)
        else:
            assert kind == ATTENTION, kind
            self.mixer = Attention(local, index_of_kind, rotary=rotary_for(cfg, device), **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=True, **kw)
        # The dense MLP: Granite's fused shared MLP, or Bamba's SwiGLU.
        if cfg.architecture == GRANITE:
            self.mlp = GatedMLP(cfg.hidden_size, local.intermediate_size, cfg.mlp_act, **kw)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, local.intermediate_size, cfg.mlp_bias, **kw)
        self.block_sparse_moe = GraniteMoE(local, **kw) if ffn_kind == MOE else None

    def forward(self, h: torch.Tensor, ctx) -> torch.Tensor:
        m = self.residual_multiplier
        h = h + self.tp.all_reduce(self.mixer(self.input_layernorm(h), ctx)) * m
        x = self.post_attention_layernorm(h)
        y = self.mlp(x)
        if self.block_sparse_moe is not None:
            y = self.block_sparse_moe(x) + y
        return h + self.tp.all_reduce(y) * m


class TwoPartForCausalLM(DecoderLM):
    """input_ids (T,) packed -> hidden (T, hidden); `compute_logits` on the rows that need them. The
    embeddings are scaled by embedding_multiplier and the logits divided by logits_scaling."""

    checkpoint_name = staticmethod(checkpoint_name)

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None, tp: TensorParallel = SINGLE) -> None:
        kw = dict(device=device, dtype=dtype or cfg.dtype)
        counts = {MAMBA: 0, ATTENTION: 0}
        blocks = []
        for kind, ffn_kind in zip(cfg.layer_types, cfg.ffn_types):
            blocks.append(TwoPartBlock(cfg, kind, ffn_kind, counts[kind], tp=tp, **kw))
            counts[kind] += 1
        super().__init__(cfg, blocks, tp=tp, cast_before_weight=True, **kw)
        self.embedding_scale = cfg.embedding_multiplier

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.config.logits_scaling
