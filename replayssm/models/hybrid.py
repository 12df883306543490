"""The hybrid decoder shared by Nemotron-H and pure Mamba-2: each block is pre-norm + mixer + residual.

Module names mirror the checkpoints (after the `model.`/`backbone.` prefix), so the loader maps
names one to one: embeddings, layers.{i}.norm, layers.{i}.mixer.*, norm_f, lm_head.
The block's mixer comes from `layer_types[i]`. Under tensor parallelism every mixer holds its
rank's shard (distributed/sharding.py) and the block all-reduces the mixer output once.
"""

from __future__ import annotations

import torch
from torch import nn

from replayssm.distributed.parallel import SINGLE, TensorParallel
from replayssm.distributed.sharding import local_config
from replayssm.models.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from replayssm.models.layers.attention import Attention
from replayssm.models.layers.mamba2 import Mamba2Mixer
from replayssm.models.layers.mlp import MLP as DenseMLP
from replayssm.models.layers.mlp import MoE
from replayssm.models.layers.norm import RMSNorm
from replayssm.models.layers.rotary import rotary_for
from replayssm.models.layers.vocab import VocabParallelEmbedding, parallel_logits


def _mamba2_norms(cfg: ModelConfig) -> bool:
    """Pure Mamba-2 checkpoints round their RMSNorm like transformers' Mamba2RMSNorm."""
    return cfg.architecture == "Mamba2ForCausalLM"


class HybridBlock(nn.Module):
    """h <- h + mixer(norm(h)); the residual stays fp32 when the config asks (Mamba-2 default)."""

    def __init__(self, cfg: ModelConfig, kind: str, index_of_kind: int, *, device=None, dtype=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.kind = kind
        self.tp = tp
        local = local_config(cfg, tp.size)  # head / intermediate counts of this rank's shard
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=_mamba2_norms(cfg),
                            device=device, dtype=dtype)
        kw = dict(device=device, dtype=dtype)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg, index_of_kind, tp=tp, **kw)
        elif kind == ATTENTION:
            self.mixer = Attention(local, index_of_kind, rotary=rotary_for(cfg, device), **kw)
        elif kind == MLP:
            self.mixer = DenseMLP(cfg.hidden_size, local.intermediate_size, cfg.mlp_act, cfg.mlp_bias, **kw)
        else:
            assert kind == MOE, kind
            self.mixer = MoE(local, **kw)

    def forward(self, h: torch.Tensor, ctx) -> torch.Tensor:
        residual = h.float() if self.residual_in_fp32 else h
        x = self.norm(h.to(self.norm.weight.dtype))
        if self.kind in (MAMBA, ATTENTION):
            x = self.mixer(x, ctx)
        else:
            x = self.mixer(x)
        return residual + self.tp.all_reduce(x)


class DecoderLM(nn.Module):
    """The frame every family shares: embeddings -> blocks -> final norm -> logits, under the
    checkpoints' names (embeddings, layers.{i}, norm_f, lm_head). A family builds its blocks and may
    scale the embeddings (`embedding_scale`) and the logits (`scale_logits`, applied in the weight's
    dtype as transformers does)."""

    embedding_scale = 1.0

    def __init__(self, cfg: ModelConfig, blocks: list[nn.Module], *, device=None, dtype=None,
                 tp: TensorParallel = SINGLE, cast_before_weight: bool) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.dtype = dtype or cfg.dtype
        kw = dict(device=device, dtype=self.dtype)
        self.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp, **kw)
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=cast_before_weight, **kw)
        # Tied checkpoints store no lm_head; the logits then reuse the embedding matrix.
        rows = self.embeddings.weight.shape[0]  # this rank's vocab rows
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, rows, bias=False, **kw)

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids (T,) int64 -> final hidden states (T, hidden) before the final norm."""
        h = self.embeddings(input_ids)
        if self.embedding_scale != 1.0:
            h = h * self.embedding_scale
        for block in self.layers:
            h = block(h, ctx)
        return h

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The family's logits scaling, or None for none."""
        return None

    def compute_logits(self, h: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """h (n, hidden) -> logits (n, vocab), fp32 (fp32=False: the weight's dtype, same values)."""
        head = self.embeddings.weight if self.lm_head is None else self.lm_head
        logits = parallel_logits(self.norm_f(h), head, self.config.vocab_size, self.tp, fp32=False)
        scaled = self.scale_logits(logits)
        logits = logits if scaled is None else scaled
        return logits.float() if fp32 else logits


class HybridForCausalLM(DecoderLM):
    """input_ids (T,) packed -> hidden (T, hidden); `compute_logits` on the rows that need them."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None, tp: TensorParallel = SINGLE) -> None:
        kw = dict(device=device, dtype=dtype or cfg.dtype)
        counts = {kind: 0 for kind in (MAMBA, ATTENTION, MLP, MOE)}
        blocks = []
        for kind in cfg.layer_types:
            blocks.append(HybridBlock(cfg, kind, counts[kind], tp=tp, **kw))
            counts[kind] += 1
        super().__init__(cfg, blocks, tp=tp, cast_before_weight=_mamba2_norms(cfg), **kw)
