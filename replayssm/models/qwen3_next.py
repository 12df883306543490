"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet hybrids (config_qwen3_next.py reads the configs).

Each layer: h <- h + mixer(norm(h)), mixer = Gated DeltaNet (layers/gated_deltanet.py) or gated full
attention; then h <- h + ffn(norm(h)), ffn = SwiGLU MLP or MoE. Every RMSNorm but the DeltaNet's output
norm scales by (1 + weight) in fp32 (transformers' GemmaRMSNorm). Gated attention: q_proj yields
[q | gate] per head, q and k are RMSNormed per head before partial RoPE, and the attention output is
multiplied by sigmoid(gate) before o_proj; it runs the engine's attention over the paged KV cache.
The MoE routes by a softmax over all experts, keeps the top k (renormalized), runs the engine's
grouped experts, and adds the shared expert times sigmoid(shared_expert_gate(x)).

Module names follow the checkpoints after `model.` (Qwen3.5's published `model.language_model.`):
layers.{i}.{input_layernorm, linear_attn | self_attn, post_attention_layernorm, mlp}; the frame's
embeddings / norm_f are embed_tokens / norm. Not served: the vision tower (`model.visual.*`). Under tensor
parallelism (distributed/sharding.py) each rank keeps whole key heads of the Gated DeltaNet with the value
heads that read them, its attention heads and its slice of every intermediate dimension; the mixer and
the FFN each end in one all-reduce. The MTP layers (`mtp.*`, `Qwen3NextMTP`) are the MTP drafter's
(speculative/mtp_model.py), sharded the same way:

    h = fc([pre_fc_norm_embedding(embed(x_{i+1})) | pre_fc_norm_hidden(h_i)])    (2*hidden -> hidden)
    h = layers.{j}(h) for each MTP layer (a gated-attention block), out = norm(h); logits = lm_head(out)

with the target's embedding and LM head, h_i its final (normed) hidden state at position i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayssm.distributed.parallel import SINGLE, TensorParallel
from replayssm.distributed.sharding import local_config
from replayssm.models.config import ATTENTION, GDN, MLP, MOE, ModelConfig
from replayssm.models.config_qwen3_next import QWEN3_NEXT
from replayssm.models.hybrid import DecoderLM
from replayssm.models.layers.attention import Attention
from replayssm.models.layers.gated_deltanet import GatedDeltaNet
from replayssm.models.layers.mlp import Experts
from replayssm.models.layers.rotary import rotary_for
from replayssm.models.two_part import SwiGLU
from replayssm.ops.attention import paged_attention, store_kv


def checkpoint_name(key: str) -> str | None:
    """Checkpoint tensor name -> our parameter name (None: not served)."""
    if key.startswith(("mtp.", "model.visual.", "visual.")):
        return None
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    if key.startswith("embed_tokens."):
        return "embeddings." + key[len("embed_tokens.") :]
    if key.startswith("norm."):
        return "norm_f." + key[len("norm.") :]
    return key


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in fp32, cast to x's dtype."""

    unit_offset = True  # models/dummy.py draws such weights near 0

    def __init__(self, size: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(Attention):
    """The engine's paged attention with Qwen's output gate and per-head q/k norms (module docstring)."""

    def __init__(self, cfg: ModelConfig, attn_index: int, *, device=None, dtype=None) -> None:
        super().__init__(cfg, attn_index, rotary=rotary_for(cfg, device), device=device, dtype=dtype)
        self.q_proj = nn.Linear(
            cfg.hidden_size, 2 * self.num_heads * self.head_dim, bias=False, device=device, dtype=dtype
        )
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.norm_eps, device=device, dtype=dtype)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        q, gate = self.q_proj(x).view(T, H, 2 * D).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, D))
        v = self.v_proj(x).view(T, self.num_kv_heads, D)
        q, k = self.rotary(ctx.positions, q, k)
        k_cache, v_cache = ctx.kv_cache.layer(self.attn_index)
        md = ctx.attn
        store_kv(k, v, k_cache, v_cache, md.slot_mapping)
        o = paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            md.cu_seqlens_q,
            md.block_tables,
            md.context_lens,
            scale=self.scale,
            max_query_len=md.max_query_len,
            max_context_len=md.max_context_len,
        )
        o = o.reshape(T, H * D) * torch.sigmoid(gate.reshape(T, H * D))
        return self.o_proj(o)


class SoftmaxRouter(nn.Module):
    """Softmax over all experts in fp32, the top k, renormalized (norm_topk_prob), in the model dtype."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, device=device, dtype=dtype))
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        top, ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids


class SparseMoE(nn.Module):
    """Routed SwiGLU experts ([gate | up] rows per expert) + the gated shared expert."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.gate = SoftmaxRouter(cfg, **kw)
        self.experts = Experts(
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, "silu", gated_act=True, **kw
        )
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.moe_shared_intermediate_size, False, **kw)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, weights, ids) + shared


class Qwen3NextBlock(nn.Module):
    """h <- h + mixer(norm(h)); h <- h + ffn(norm(h))."""

    def __init__(
        self, cfg: ModelConfig, kind: str, ffn_kind: str, index_of_kind: int, *, device=None, dtype=None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.kind = kind
        self.tp = tp
        local = local_config(cfg, tp.size)  # head and intermediate counts of this rank's shard
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.norm_eps, **kw)
        if kind == GDN:
            fused = cfg.architecture == QWEN3_NEXT
            self.linear_attn = GatedDeltaNet(local, index_of_kind, fused_projections=fused, **kw)
        else:
            assert kind == ATTENTION, kind
            self.self_attn = GatedAttention(local, index_of_kind, **kw)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.norm_eps, **kw)
        self.mlp = (
            SparseMoE(local, **kw)
            if ffn_kind == MOE
            else SwiGLU(cfg.hidden_size, local.intermediate_size, False, **kw)
        )

    @property
    def mixer(self) -> nn.Module:
        """The engine's handle on the layer's mixer (its recurrent caches or KV cache)."""
        return self.linear_attn if self.kind == GDN else self.self_attn

    def forward(self, h: torch.Tensor, ctx) -> torch.Tensor:
        # Row-parallel out_proj / o_proj / down projections leave partial sums (sigmoid(shared_expert_gate)
        # scales the shared expert's partial sum, which is linear).
        h = h + self.tp.all_reduce(self.mixer(self.input_layernorm(h), ctx))
        return h + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(h)))


class Qwen3NextForCausalLM(DecoderLM):
    """input_ids (T,) packed -> hidden (T, hidden); `compute_logits` on the rows that need them."""

    checkpoint_name = staticmethod(checkpoint_name)

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None, tp: TensorParallel = SINGLE) -> None:
        kw = dict(device=device, dtype=dtype or cfg.dtype)
        counts = {GDN: 0, ATTENTION: 0}
        blocks = []
        for kind, ffn_kind in zip(cfg.layer_types, cfg.ffn_types):
            blocks.append(Qwen3NextBlock(cfg, kind, ffn_kind, counts[kind], tp=tp, **kw))
            counts[kind] += 1
        super().__init__(cfg, blocks, tp=tp, cast_before_weight=False, **kw)
        self.norm_f = OffsetRMSNorm(cfg.hidden_size, cfg.norm_eps, **kw)


def mtp_ffn_kind(cfg: ModelConfig) -> str:
    """The FFN of the MTP layers: the routed experts wherever the model has them (the published
    checkpoints route every layer), else the dense MLP."""
    return MOE if cfg.num_experts else MLP


class Qwen3NextMTP(nn.Module):
    """(next-token embeddings (T, hidden), normed target hidden (T, hidden), ctx) -> (T, hidden); the
    module docstring has the math. Its attention layers use the MTP head's own KV cache (index j)."""

    def __init__(self, cfg: ModelConfig, *, device=None, dtype=None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if not cfg.num_nextn_predict_layers:
            raise ValueError("speculative_method='mtp' needs a checkpoint with mtp_num_hidden_layers >= 1; "
                             "this one has none")
        kw = dict(device=device, dtype=dtype)
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False, **kw)
        self.pre_fc_norm_embedding = OffsetRMSNorm(H, cfg.norm_eps, **kw)
        self.pre_fc_norm_hidden = OffsetRMSNorm(H, cfg.norm_eps, **kw)
        ffn = mtp_ffn_kind(cfg)
        self.layers = nn.ModuleList(
            Qwen3NextBlock(cfg, ATTENTION, ffn, j, tp=tp, **kw) for j in range(cfg.num_nextn_predict_layers)
        )
        self.norm = OffsetRMSNorm(H, cfg.norm_eps, **kw)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx) -> torch.Tensor:
        h = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            h = layer(h, ctx)
        return self.norm(h)
