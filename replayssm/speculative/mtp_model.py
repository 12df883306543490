"""Multi-token-prediction (MTP) heads, read from the checkpoint's `mtp.*` tensors: Nemotron-H's
(below) and Qwen3-Next / Qwen3.5's (`models/qwen3_next.py: Qwen3NextMTP`, one gated-attention block
behind fc over the two normed inputs). Both take the same inputs and share the target's
embedding and LM head, so `load_mtp` picks the class by architecture and the drafter is the same.

transformers has no MTP module (it ignores `mtp.*` on load), so this follows the public
Nemotron-H MTP design. One MTP step at position i takes the target's final hidden state h_i
(after norm_f) and the embedding of the next token x_{i+1}, and predicts x_{i+2}:

    e = enorm(embed(x_{i+1}))          embed = the target's embedding (shared)
    g = hnorm(h_i)
    h = eh_proj([e, g])                (2*hidden -> hidden, no bias)
    h = block(h) for each layer in mtp_layers_block_type   (pre-norm residual blocks)
    out = final_layernorm(h);  logits = lm_head(out)        lm_head = the target's (shared)

Checkpoint names: mtp.layers.{i}.{norm,mixer.*}, plus enorm / hnorm / eh_proj on layer 0 and
final_layernorm on the last layer. The MTP attention layers keep their own paged KV cache,
addressed with the request's block table (the same block ids as the target's KV).

Under tensor parallelism the MTP blocks shard like the target's (attention heads, MLP and expert
intermediate slices; each block all-reduces its output once); enorm, hnorm, eh_proj and
final_layernorm are replicated. The shared embedding and LM head are the target's vocab-parallel
ones, so the MTP logits come from the same all-gather as the target's.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
from torch import nn

from replayssm.distributed.parallel import SINGLE, TensorParallel
from replayssm.distributed.sharding import check_shardable, read_shard
from replayssm.models.config import ATTENTION, LAYER_TYPES, MAMBA, ModelConfig
from replayssm.models.config_qwen3_next import GDN_ARCHITECTURES
from replayssm.models.hybrid import HybridBlock
from replayssm.models.layers.norm import RMSNorm
from replayssm.models.loader import load_weights
from replayssm.models.qwen3_next import Qwen3NextMTP, mtp_ffn_kind


class MTPLayer(HybridBlock):
    """A Nemotron-H block plus the MTP fusion (first layer) or the closing norm (last layer)."""

    def __init__(self, cfg: ModelConfig, kind: str, index_of_kind: int, *, first: bool, last: bool,
                 device=None, dtype=None, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, kind, index_of_kind, device=device, dtype=dtype, tp=tp)
        kw = dict(device=device, dtype=dtype)
        if first:
            self.enorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, **kw)
            self.hnorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, **kw)
            self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False, **kw)
        if last:
            self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, **kw)


class NemotronHMTP(nn.Module):
    """(next-token embeddings (T, hidden), normed target hidden (T, hidden), ctx) -> (T, hidden)."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if cfg.num_nextn_predict_layers != 1 or not cfg.mtp_layer_types:
            raise ValueError("speculative_method='mtp' needs a checkpoint with num_nextn_predict_layers=1 "
                             "and mtp_layers_block_type; this one has num_nextn_predict_layers="
                             f"{cfg.num_nextn_predict_layers}")
        if MAMBA in cfg.mtp_layer_types:
            raise ValueError("MTP layers of type mamba are not supported (attention, mlp and moe are)")
        counts = dict.fromkeys(LAYER_TYPES, 0)
        layers = []
        n = len(cfg.mtp_layer_types)
        for i, kind in enumerate(cfg.mtp_layer_types):
            layers.append(MTPLayer(cfg, kind, counts[kind], first=i == 0, last=i == n - 1,
                                   device=device, dtype=dtype, tp=tp))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.num_attention_layers = counts[ATTENTION]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx) -> torch.Tensor:
        first = self.layers[0]
        h = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(hidden)], dim=-1))
        for layer in self.layers:
            h = layer(h, ctx)
        return self.layers[-1].final_layernorm(h)


def mtp_tensor_name(key: str) -> str | None:
    """Checkpoint name -> NemotronHMTP parameter name (None for non-MTP tensors)."""
    for prefix in ("language_model.", "model.", "backbone."):
        key = key.removeprefix(prefix)
    return key[len("mtp."):] if key.startswith("mtp.") else None


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The config whose layer_types are the MTP layers (for sharding rules and the KV cache)."""
    if cfg.architecture in GDN_ARCHITECTURES:
        kinds = (mtp_ffn_kind(cfg),) * len(cfg.mtp_layer_types)
        return dataclasses.replace(cfg, layer_types=cfg.mtp_layer_types, ffn_types=kinds)
    return dataclasses.replace(cfg, layer_types=cfg.mtp_layer_types)


def load_mtp(cfg: ModelConfig, path: str | Path, *, device: torch.device, dtype: torch.dtype,
             tp: TensorParallel = SINGLE) -> nn.Module:
    """Build the MTP head (rank tp.rank's shard) and fill every parameter from the checkpoint's
    mtp.* tensors."""
    cls = Qwen3NextMTP if cfg.architecture in GDN_ARCHITECTURES else NemotronHMTP
    with torch.device("meta"):
        mtp = cls(cfg, dtype=dtype, tp=tp)
    mtp = mtp.to_empty(device=device)
    if tp.size == 1:
        load_weights(mtp, path, rename=mtp_tensor_name)
    else:
        layers = mtp_config(cfg)
        check_shardable(layers, tp.size)
        load_weights(mtp, path, rename=mtp_tensor_name, read=functools.partial(read_shard, layers, tp))
    return mtp.eval().requires_grad_(False)
