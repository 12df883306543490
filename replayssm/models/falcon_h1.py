"""Falcon-H1 (`FalconH1ForCausalLM`): parallel hybrid layers, attention and Mamba-2 side by side.

With the multipliers of config_falcon_h1.FalconH1Multipliers (names shortened), as transformers
applies them:

    h = embed(ids) * embedding_multiplier
    per layer i:  x = input_layernorm(h)
                  h = h + (ssm_out * mamba(x) + attention_out * attention(attention_in * x))
                  h = h + mlp(pre_ff_layernorm(h))
    mamba(x):     zxbcdt = in_proj(ssm_in * x) * [z | x | B | C | dt segment multipliers]   (mup_vector)
                  ... conv, scan as every Mamba-2 mixer ...
                  y = norm(y * silu(z)) | norm(y) * silu(z) | y * silu(z)    (mamba_rms_norm and
                  mamba_norm_before_gate pick one), out_proj (bias: projectors_bias)
    attention:    RoPE attention, k_proj's output times key before RoPE and the cache (in the model
                  dtype, as transformers rounds it)
    mlp(x):       down_proj(up_proj(x) * silu(gate_proj(x) * mlp_gate)) * mlp_down
    logits = lm_head(final_layernorm(h)) * lm_head

Each layer is of kind "parallel": it owns one Mamba cache (its `.mixer`, the Mamba2Mixer with
ReplaySSM, as the engine expects of every Mamba layer) and one attention KV cache (`.self_attn`),
numbered by the layer index. Norms cast before the weight, as FalconH1RMSNorm does.
Under tensor parallelism the Mamba-2 mixer holds its rank's heads (the in_proj segment multipliers
follow the local segments), the attention its heads and the MLP its intermediate slice
(distributed/sharding.py); the block all-reduces the sum of both branches once and the MLP output
once (each multiplier scales a partial sum, which is linear, and the row-parallel biases are on
rank 0 only).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from replayssm.distributed.parallel import SINGLE, TensorParallel
from replayssm.distributed.sharding import local_config
from replayssm.models.config import ModelConfig
from replayssm.models.config_falcon_h1 import FalconH1Multipliers
from replayssm.models.hybrid import DecoderLM
from replayssm.models.layers.attention import Attention
from replayssm.models.layers.mamba2 import Mamba2Mixer
from replayssm.models.layers.norm import RMSNorm
from replayssm.models.layers.rotary import rotary_for

_RENAMES = (
    (re.compile(r"^embed_tokens\."), "embeddings."),
    (re.compile(r"^final_layernorm\."), "norm_f."),
    (re.compile(r"^(layers\.\d+)\.mamba\."), r"\1.mixer."),
)


def checkpoint_name(key: str) -> str | None:
    """Checkpoint tensor name -> our parameter name (None: a derived buffer we recompute)."""
    key = key.removeprefix("model.")
    if key.endswith(".mup_vector"):
        return None
    for pattern, repl in _RENAMES:
        new, n = pattern.subn(repl, key)
        if n:
            return new
    return key


class MupInProj(nn.Linear):
    """in_proj(ssm_in * x) times the per-segment multipliers of [z | x | B | C | dt] (transformers'
    mup_vector). The vector is built from the config on first use per device and dtype, in the
    projection's dtype: transformers' buffer takes the model dtype, so in bf16 each multiplier is
    rounded to bf16 and the product is one bf16 multiply, as here."""

    def __init__(self, hidden: int, sizes: tuple[int, ...], m: FalconH1Multipliers, *, bias: bool,
                 device=None, dtype=None) -> None:
        super().__init__(hidden, sum(sizes), bias=bias, device=device, dtype=dtype)
        self.sizes, self.ssm_in, self.segments = sizes, m.ssm_in, m.ssm_zxbcdt
        self._mup: torch.Tensor | None = None

    def mup_vector(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if self._mup is None or self._mup.device != device or self._mup.dtype != dtype:
            self._mup = torch.cat([torch.full((n,), v, dtype=dtype, device=device)
                                   for n, v in zip(self.sizes, self.segments)])
        return self._mup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x * self.ssm_in)
        return y * self.mup_vector(y.device, y.dtype)


class FalconMamba(Mamba2Mixer):
    """Mamba2Mixer with Falcon-H1's input multipliers, gated-norm variants and out_proj bias."""

    def __init__(self, cfg: ModelConfig, mamba_index: int, *, device=None, dtype=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, mamba_index, device=device, dtype=dtype, tp=tp)
        m = cfg.falcon_h1
        gn = self.G * self.N
        self.in_proj = MupInProj(cfg.hidden_size, (self.I, self.I, gn, gn, self.H), m,
                                 bias=cfg.mamba_proj_bias, device=device, dtype=dtype)
        self.out_proj = nn.Linear(self.I, cfg.hidden_size, bias=m.projectors_bias, device=device, dtype=dtype)
        self.rms_norm, self.norm_before_gate = m.mamba_rms_norm, m.mamba_norm_before_gate
        if not self.rms_norm:
            self.norm = None  # no norm weight in the checkpoint

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if not self.rms_norm:
            return y * F.silu(z)
        if not self.norm_before_gate:
            return super()._gated_norm(y, z)  # norm(y * silu(z))
        # FalconH1RMSNormGated, norm before gate: fp32 grouped norm, weight, then the fp32 gate.
        sh = self.shard
        if sh.norm_group is None:
            g = y.float().unflatten(-1, (self.G, self.I // self.G))
            g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        else:
            # The group spans ranks: its sum of squares is all-reduced (as the base mixer's norm does).
            g = y.float()
            sq = g.new_zeros(g.shape[0], sh.num_norm_groups)
            sq[:, sh.norm_group] = g.pow(2).sum(-1)
            self.tp.all_reduce(sq)
            g = g * torch.rsqrt(sq[:, sh.norm_group:sh.norm_group + 1] / sh.norm_group_size + self.eps)
        g = self.norm.weight * g
        return (g * F.silu(z.float())).to(y.dtype)


class ScaledLinear(nn.Linear):
    """A projection whose output is multiplied by a constant (Falcon-H1's key multiplier)."""

    def __init__(self, n_in: int, n_out: int, multiplier: float, *, bias: bool, device=None, dtype=None):
        super().__init__(n_in, n_out, bias=bias, device=device, dtype=dtype)
        self.multiplier = multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.multiplier


class FalconMLP(nn.Module):
    """down_proj(up_proj(x) * silu(gate_proj(x) * mlp_gate)) * mlp_down."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(bias=cfg.mlp_bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)
        self.gate_multiplier, self.down_multiplier = cfg.falcon_h1.mlp_gate, cfg.falcon_h1.mlp_down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * F.silu(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class ParallelBlock(nn.Module):
    """h <- h + (ssm_out * mamba(x) + attention_out * attention(attention_in * x)), x = norm(h);
    h <- h + mlp(norm(h))."""

    kind = "parallel"

    def __init__(self, cfg: ModelConfig, index: int, *, device=None, dtype=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        m = cfg.falcon_h1
        kw = dict(device=device, dtype=dtype)
        self.m, self.tp = m, tp
        local = local_config(cfg, tp.size)  # head and intermediate counts of this rank's shard
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=True, **kw)
        self.mixer = FalconMamba(cfg, index, tp=tp, **kw)
        self.self_attn = Attention(local, index, rotary=rotary_for(cfg, device), **kw)
        k = self.self_attn.k_proj
        self.self_attn.k_proj = ScaledLinear(k.in_features, k.out_features, m.key, bias=k.bias is not None,
                                             **kw)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=True, **kw)
        self.feed_forward = FalconMLP(local, **kw)

    def forward(self, h: torch.Tensor, ctx) -> torch.Tensor:
        x = self.input_layernorm(h)
        mamba = self.mixer(x, ctx) * self.m.ssm_out
        attention = self.self_attn(x * self.m.attention_in, ctx) * self.m.attention_out
        h = h + self.tp.all_reduce(mamba + attention)
        return h + self.tp.all_reduce(self.feed_forward(self.pre_ff_layernorm(h)))


class FalconH1ForCausalLM(DecoderLM):
    """input_ids (T,) packed -> hidden (T, hidden); `compute_logits` on the rows that need them. The
    embeddings are scaled by embedding_multiplier and the logits by lm_head_multiplier."""

    checkpoint_name = staticmethod(checkpoint_name)

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None, tp: TensorParallel = SINGLE) -> None:
        kw = dict(device=device, dtype=dtype or cfg.dtype)
        blocks = [ParallelBlock(cfg, i, tp=tp, **kw) for i in range(cfg.num_layers)]
        super().__init__(cfg, blocks, tp=tp, cast_before_weight=True, **kw)
        self.embedding_scale = cfg.embedding_multiplier

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.config.falcon_h1.lm_head
