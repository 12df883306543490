"""Attention of the hybrids: GQA projections over the paged KV cache, optionally rotary.

Nemotron-H attention layers carry no positional encoding (the Mamba layers supply position);
RoPE hybrids (Bamba, Falcon-H1) pass a `RotaryEmbedding`, which turns q and k by each token's
absolute position (`ctx.positions`) before k enters the cache, so cached keys stay rotated by
the position they were computed at.

With an FP8 KV cache (`--kv-cache-dtype fp8`) the layer's K and V are stored in E4M3 divided by its
per-tensor `k_scale` / `v_scale`: the checkpoint's (`models/loader.py: load_kv_scales`), else 1.0.
"""

from __future__ import annotations

import torch
from torch import nn

from replayssm.models.config import ModelConfig
from replayssm.models.layers.rotary import RotaryEmbedding
from replayssm.ops.attention import paged_attention, store_kv
from replayssm.ops.fp8 import FP8_DTYPE


class Attention(nn.Module):
    """x (T, hidden) -> (T, hidden); stores this step's K/V, then attends causally over the cache."""

    def __init__(self, cfg: ModelConfig, attn_index: int, *, rotary: RotaryEmbedding | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.attn_index = attn_index  # which KV cache pair of the model this layer owns
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_scale or self.head_dim ** -0.5  # Granite: its attention_multiplier
        kw = dict(bias=cfg.attention_bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, **kw)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, **kw)
        self.rotary = rotary
        # FP8 KV cache scales (host floats: fixed after loading, so CUDA graphs keep them).
        self.k_scale = self.v_scale = 1.0

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(ctx.positions, q, k)
        k_cache, v_cache = ctx.kv_cache.layer(self.attn_index)
        md = ctx.attn
        fp8 = k_cache.dtype == FP8_DTYPE
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale) if fp8 else {}
        store_kv(k, v, k_cache, v_cache, md.slot_mapping, **scales)
        o = paged_attention(q, k_cache, v_cache, md.cu_seqlens_q, md.block_tables, md.context_lens,
                            scale=self.scale, max_query_len=md.max_query_len,
                            max_context_len=md.max_context_len, **scales)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
