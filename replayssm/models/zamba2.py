"""Zyphra Zamba2 (`Zamba2ForCausalLM`): a Mamba-2 backbone with shared transformer blocks.

As transformers computes it (e = the token embeddings, kept beside the residual stream h):

    mamba layer i:   h = h + mamba(input_layernorm(h))
    hybrid layer i:  (the j-th hybrid layer; shared block b = j % num_mem_blocks, LoRA adapters j)
                     x = norm_b(concat(h, e))                                    (2 * hidden wide)
                     q, k, v = W_b x + B_j A_j x      (adapters only with use_shared_attention_adapter)
                     a = pre_ff_norm_b(o_proj_b(attention(q, k, v)))    (softmax scale (head_dim / 2)^-1/2,
                                                                           RoPE with use_mem_rope)
                     g | u = gate_up_b(a) + B_j A_j a;  t = linear_i(down_b(act(g) * u))
                     h = h + mamba(input_layernorm(h + t))
    mamba(x):        the Mamba-2 mixer, gated norm norm(y * silu(z)) with eps 1e-5
    logits = lm_head(final_layernorm(h))

The shared blocks (`shared.{b}`) are modules of the model, not of the layers; each hybrid layer owns
its adapters, its `linear` and one KV cache (kind "parallel": KV cache index = its rank among the
hybrid layers, Mamba cache index = its layer index). The shared block has no residual of its own.
transformers ties the blocks' weights only when tie_word_embeddings is true (its weight tying follows
that flag); untied, every hybrid layer runs a block of its own, as the checkpoint then stores, and so
do we. Norms cast before the weight, as Zamba2RMSNorm does.

Under tensor parallelism (distributed/sharding.py) the Mamba-2 mixers hold their rank's heads, the
shared attention its heads and the shared MLP its intermediate slice; an adapter's A is replicated
and its B holds the rows of the projection it adds to, so q, k, v and [gate | up] stay exact local
slices. A hybrid layer all-reduces three partial sums: after o_proj (pre_ff_norm needs the whole
row), after down_proj (before `linear`, replicated) and after the Mamba-2 out_proj.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from replayssm.distributed.parallel import SINGLE, TensorParallel
from replayssm.distributed.sharding import local_config
from replayssm.models.config import MAMBA, PARALLEL, ModelConfig
from replayssm.models.hybrid import DecoderLM
from replayssm.models.layers.mamba2 import Mamba2Mixer
from replayssm.models.layers.norm import RMSNorm
from replayssm.models.layers.rotary import RotaryEmbedding, rotary_for
from replayssm.ops.attention import paged_attention, store_kv

_MAMBA_EPS = 1e-5  # Zamba2RMSNormGated's eps, whatever rms_norm_eps says
_ADAPTER = re.compile(r"^layers\.\d+\.shared_transformer\.(self_attn\.linear_([qkv])_adapter_list|"
                      r"feed_forward\.gate_up_proj_adapter_list)\.(\d+)\.(.*)$")
_SHARED = re.compile(r"^layers\.(\d+)\.shared_transformer\.(.*)$")
_MAMBA = re.compile(r"^layers\.(\d+)\.(?:mamba_decoder\.)?(?:mamba\.|(?=input_layernorm\.))(.*)$")


def _adapter(n_in: int, rank: int, n_out: int, **kw) -> nn.Sequential:
    """x -> B(A x), no biases (checkpoint names .0.weight = A, .1.weight = B)."""
    return nn.Sequential(nn.Linear(n_in, rank, bias=False, **kw), nn.Linear(rank, n_out, bias=False, **kw))


class SharedBlock(nn.Module):
    """The weights of one shared transformer block (run by Zamba2Layer with a layer's adapters)."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        wide, d = 2 * cfg.hidden_size, cfg.head_dim
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.input_layernorm = RMSNorm(wide, cfg.norm_eps, cast_before_weight=True, **kw)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(wide, heads * d, bias=False, **kw)
        self.self_attn.k_proj = nn.Linear(wide, kv * d, bias=False, **kw)
        self.self_attn.v_proj = nn.Linear(wide, kv * d, bias=False, **kw)
        self.self_attn.o_proj = nn.Linear(heads * d, cfg.hidden_size, bias=False, **kw)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=True, **kw)
        self.feed_forward = nn.Module()
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.feed_forward.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=cfg.mlp_bias, **kw)
        self.feed_forward.down_proj = nn.Linear(inter, hidden, bias=cfg.mlp_bias, **kw)


class Zamba2Mamba(Mamba2Mixer):
    """The Mamba-2 mixer with Zamba2's fixed gated-norm eps."""

    def __init__(self, cfg: ModelConfig, mamba_index: int, *, device=None, dtype=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, mamba_index, device=device, dtype=dtype, tp=tp)
        self.eps = _MAMBA_EPS


class Zamba2Layer(nn.Module):
    """A Mamba layer, or (kind "parallel") a hybrid layer: the shared block's output through `linear`
    joins the Mamba input; the residual skips both. `cfg` is the full config; head and intermediate
    counts below are this rank's."""

    def __init__(self, cfg: ModelConfig, index: int, kind: str, attn_index: int, *,
                 rotary: RotaryEmbedding | None, device=None, dtype=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.kind, self.tp = kind, tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cast_before_weight=True, **kw)
        self.mixer = Zamba2Mamba(cfg, index, tp=tp, **kw)
        if kind == MAMBA:
            return
        z = cfg.zamba2
        cfg = local_config(cfg, tp.size)  # from here on: this rank's head and intermediate counts
        wide, d = 2 * cfg.hidden_size, cfg.head_dim
        self.attn_index, self.rotary = attn_index, rotary
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.scale = (d / 2) ** -0.5
        self.act = F.gelu if cfg.mlp_act == "gelu" else F.silu
        self.linear = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False, **kw)
        if z.attention_adapter:
            self.q_adapter = _adapter(wide, z.adapter_rank, self.heads * d, **kw)
            self.k_adapter = _adapter(wide, z.adapter_rank, self.kv_heads * d, **kw)
            self.v_adapter = _adapter(wide, z.adapter_rank, self.kv_heads * d, **kw)
        self.mlp_adapter = _adapter(cfg.hidden_size, z.adapter_rank, 2 * cfg.intermediate_size, **kw)
        self.shared: tuple[SharedBlock] | None = None  # set by the model (a tuple: not a submodule)

    def _transformer(self, h: torch.Tensor, e: torch.Tensor, ctx) -> torch.Tensor:
        block = self.shared[0]
        attn, ff = block.self_attn, block.feed_forward
        T = h.shape[0]
        x = block.input_layernorm(torch.cat([h, e], dim=-1))
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if hasattr(self, "q_adapter"):
            q, k, v = q + self.q_adapter(x), k + self.k_adapter(x), v + self.v_adapter(x)
        q = q.view(T, self.heads, self.head_dim)
        k = k.view(T, self.kv_heads, self.head_dim)
        v = v.view(T, self.kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(ctx.positions, q, k)
        k_cache, v_cache = ctx.kv_cache.layer(self.attn_index)
        md = ctx.attn
        store_kv(k, v, k_cache, v_cache, md.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, md.cu_seqlens_q, md.block_tables, md.context_lens,
                            scale=self.scale, max_query_len=md.max_query_len,
                            max_context_len=md.max_context_len)
        a = block.pre_ff_layernorm(self.tp.all_reduce(attn.o_proj(o.reshape(T, self.heads * self.head_dim))))
        gate, up = (ff.gate_up_proj(a) + self.mlp_adapter(a)).chunk(2, dim=-1)
        return self.linear(self.tp.all_reduce(ff.down_proj(self.act(gate) * up)))

    def forward(self, h: torch.Tensor, e: torch.Tensor, ctx) -> torch.Tensor:
        x = h if self.kind == MAMBA else h + self._transformer(h, e, ctx)
        return h + self.tp.all_reduce(self.mixer(self.input_layernorm(x), ctx))


class Zamba2ForCausalLM(DecoderLM):
    """input_ids (T,) packed -> hidden (T, hidden); `compute_logits` on the rows that need them."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None, tp: TensorParallel = SINGLE) -> None:
        kw = dict(device=device, dtype=dtype or cfg.dtype)
        rotary = rotary_for(cfg, device)
        hybrid_ids = [i for i, kind in enumerate(cfg.layer_types) if kind == PARALLEL]
        blocks = [Zamba2Layer(cfg, i, kind, hybrid_ids.index(i) if kind == PARALLEL else -1,
                              rotary=rotary, tp=tp, **kw) for i, kind in enumerate(cfg.layer_types)]
        super().__init__(cfg, blocks, tp=tp, cast_before_weight=True, **kw)
        self.hybrid_ids = hybrid_ids
        nb = cfg.zamba2.num_mem_blocks if cfg.tie_word_embeddings else len(hybrid_ids)
        nb = min(nb, max(len(hybrid_ids), 1))
        local = local_config(cfg, tp.size)
        self.shared = nn.ModuleList(SharedBlock(local, **kw) for _ in range(nb))
        for j, i in enumerate(self.hybrid_ids):
            self.layers[i].shared = (self.shared[j % nb],)

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        e = self.embeddings(input_ids)
        h = e
        for layer in self.layers:
            h = layer(h, e, ctx)
        return h

    def checkpoint_name(self, key: str) -> str | None:
        """Checkpoint tensor name -> our parameter name (None: skipped). transformers stores shared
        block b (b < nb) under hybrid layer b, with the adapters of every hybrid layer j on block j % nb;
        the copies other layers may hold (untied checkpoints) are not read."""
        key = key.removeprefix("model.")
        if key.startswith("embed_tokens."):
            return "embeddings." + key.removeprefix("embed_tokens.")
        if key.startswith("final_layernorm."):
            return "norm_f." + key.removeprefix("final_layernorm.")
        hyb, nb = self.hybrid_ids, len(self.shared)
        m = _ADAPTER.match(key)
        if m:
            i, j = int(key.split(".")[1]), int(m.group(3))
            if j >= len(hyb) or i != hyb[j % nb]:
                return None
            name = f"{m.group(2)}_adapter" if m.group(2) else "mlp_adapter"
            return f"layers.{hyb[j]}.{name}.{m.group(4)}"
        m = _SHARED.match(key)
        if m:
            i = int(m.group(1))
            if i not in hyb[:nb]:
                return None
            return f"shared.{hyb.index(i)}.{m.group(2)}"
        m = _MAMBA.match(key)
        if m:
            return f"layers.{m.group(1)}.{'mixer.' if '.mamba.' in key else ''}{m.group(2)}"
        return key
