"""The hybrid decoder shared by Nemotron-H and pure Mamba-2: each block is pre-norm + mixer + residual.

Module names mirror the checkpoints (after the `model.`/`backbone.` prefix), so the loader maps
names one to one: embeddings, layers.{i}.norm, layers.{i}.mixer.*, norm_f, lm_head.
The block's mixer comes from `layer_types[i]`.
"""

from __future__ import annotations

import torch
from torch import nn

from replayssm.models.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from replayssm.models.layers.attention import Attention
from replayssm.models.layers.mamba2 import Mamba2Mixer
from replayssm.models.layers.mlp import MLP as DenseMLP
from replayssm.models.layers.mlp import MoE
from replayssm.models.layers.norm import RMSNorm


def _mamba2_norms(cfg: ModelConfig) -> bool:
    """Pure Mamba-2 checkpoints round their RMSNorm like transformers' Mamba2RMSNorm."""
    return cfg.architecture == "Mamba2ForCausalLM"


class HybridBlock(nn.Module):
    """h <- h + mixer(norm(h)); the residual stays fp32 when the config asks (Mamba-2 default)."""

    def __init__(self, cfg: ModelConfig, kind: str, index_of_kind: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.kind = kind
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=_mamba2_norms(cfg),
                            device=device, dtype=dtype)
        kw = dict(device=device, dtype=dtype)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg, index_of_kind, **kw)
        elif kind == ATTENTION:
            self.mixer = Attention(cfg, index_of_kind, **kw)
        elif kind == MLP:
            self.mixer = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, cfg.mlp_bias, **kw)
        else:
            assert kind == MOE, kind
            self.mixer = MoE(cfg, **kw)

    def forward(self, h: torch.Tensor, ctx) -> torch.Tensor:
        residual = h.float() if self.residual_in_fp32 else h
        x = self.norm(h.to(self.norm.weight.dtype))
        if self.kind in (MAMBA, ATTENTION):
            x = self.mixer(x, ctx)
        else:
            x = self.mixer(x)
        return residual + x


class HybridForCausalLM(nn.Module):
    """input_ids (T,) packed -> hidden (T, hidden); `compute_logits` on the rows that need them."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype or cfg.dtype
        kw = dict(device=device, dtype=self.dtype)
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        counts = {kind: 0 for kind in (MAMBA, ATTENTION, MLP, MOE)}
        blocks = []
        for kind in cfg.layer_types:
            blocks.append(HybridBlock(cfg, kind, counts[kind], **kw))
            counts[kind] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=_mamba2_norms(cfg), **kw)
        # Tied checkpoints store no lm_head; the logits then reuse the embedding matrix.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                      bias=False, **kw)

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids (T,) int64 -> final hidden states (T, hidden) before the final norm."""
        h = self.embeddings(input_ids)
        for block in self.layers:
            h = block(h, ctx)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (n, hidden) -> fp32 logits (n, vocab)."""
        weight = self.embeddings.weight if self.lm_head is None else self.lm_head.weight
        h = self.norm_f(h)
        return torch.nn.functional.linear(h.to(weight.dtype), weight).float()
