"""Gated DeltaNet mixer (Qwen3-Next, Qwen3.5) over pooled per-slot state, behind the Mamba-2 cache contract.

Tokens arrive packed, prefill rows first, then decode rows (see engine/context.py):

    projections -> q, k (Hk, Dk), v, z (Hv, Dv), b, a (Hv)
        Qwen3-Next: in_proj_qkvz and in_proj_ba, grouped per key head ([q k v z] and [b a] per group);
        Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    short causal conv (silu) over [q | k | v]; g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    prefill tokens: causal_conv1d_varlen -> gdn_chunked_varlen_ref (writes clean S_0 and conv window;
                    prefix-cache checkpoints: the state at a boundary + the K-1 conv inputs before it)
    decode rows:    causal_conv1d_update (window unchanged; inputs parked for the commit)
                    -> gdn_replay_forward (ReplaySSM) | gdn_state_update (off)
    -> gated RMSNorm per value head (norm, then times silu(z)) -> out_proj

The cache (cache/mamba_cache.py) holds a (Hv, Dk, Dv) state and a ring of (k, e, g) per slot (e:
each token's delta, fp32); cursors, conv windows, commit and publication are the engine's, unchanged
(docs/design.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayssm.models.config import ModelConfig
from replayssm.models.layers.mamba2 import Mamba2Mixer
from replayssm.ops.common import store_states
from replayssm.ops.conv1d import causal_conv1d_update, causal_conv1d_varlen
from replayssm.ops.gdn import (
    gdn_chunked_varlen_ref,
    gdn_replay_forward,
    gdn_replay_materialize,
    gdn_state_update,
)


class GatedRMSNorm(nn.Module):
    """Per value head: x / rms(x) in fp32, cast, times weight, times silu(z) in fp32 (transformers'
    Qwen3NextRMSNormGated: the norm before the gate)."""

    def __init__(self, size: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """x (T, hidden) -> (T, hidden); reads and writes the layer's slots in ctx.mamba_cache."""

    def __init__(
        self, cfg: ModelConfig, layer_index: int, *, fused_projections: bool, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.mamba_index = layer_index  # which per-layer recurrent cache tensors this layer owns
        self.Hk, self.Hv = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads
        self.Dk, self.Dv = cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
        self.key_dim, self.value_dim = self.Hk * self.Dk, self.Hv * self.Dv
        self.conv_dim = cfg.gdn_conv_dim
        self.fused = fused_projections
        kw = dict(device=device, dtype=dtype)
        H = cfg.hidden_size
        if fused_projections:
            self.in_proj_qkvz = nn.Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False, **kw)
            self.in_proj_ba = nn.Linear(H, 2 * self.Hv, bias=False, **kw)
        else:
            self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False, **kw)
            self.in_proj_z = nn.Linear(H, self.value_dim, bias=False, **kw)
            self.in_proj_b = nn.Linear(H, self.Hv, bias=False, **kw)
            self.in_proj_a = nn.Linear(H, self.Hv, bias=False, **kw)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim, bias=False, **kw
        )
        # Decay parameters stay fp32 whatever the model dtype (g is computed in fp32).
        self.dt_bias = nn.Parameter(torch.empty(self.Hv, device=device, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.Hv, device=device, dtype=torch.float32))
        self.norm = GatedRMSNorm(self.Dv, cfg.norm_eps, **kw)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False, **kw)

    def _project(self, x: torch.Tensor):
        """x (T, hidden) -> (qkv (T, conv_dim) as [q | k | v], z (T, Hv, Dv), b, a (T, Hv))."""
        T = x.shape[0]
        if not self.fused:
            return (
                self.in_proj_qkv(x),
                self.in_proj_z(x).view(T, self.Hv, self.Dv),
                self.in_proj_b(x),
                self.in_proj_a(x),
            )
        r = self.Hv // self.Hk
        qkvz = self.in_proj_qkvz(x).view(T, self.Hk, 2 * self.Dk + 2 * r * self.Dv)
        q, k, v, z = qkvz.split([self.Dk, self.Dk, r * self.Dv, r * self.Dv], dim=-1)
        b, a = self.in_proj_ba(x).view(T, self.Hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, self.Hv, self.Dv), b.reshape(T, self.Hv), a.reshape(T, self.Hv)

    def forward(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        qkv, z, b, a = self._project(hidden)
        beta = b.sigmoid().float()  # sigmoid in the model dtype, as transformers computes it
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0, :]
        md = ctx.mamba
        Tp = md.num_prefill_tokens
        seed = ctx.rand_seed[self.mamba_index]
        parts = []
        if Tp:
            parts.append(self._prefill(qkv[:Tp], g[:Tp], beta[:Tp], weight, ctx, seed))
        if md.num_decode_rows:
            parts.append(self._decode(qkv[Tp:], g[Tp:], beta[Tp:], weight, ctx, seed))
        o = parts[0] if len(parts) == 1 else torch.cat(parts)  # (T, Hv, Dv) in the model dtype
        y = self.norm(o, z).reshape(-1, self.value_dim)
        return self.out_proj(y)

    def materialize(
        self,
        cache,
        layer: int,
        src: torch.Tensor,
        num_entries: torch.Tensor,
        dst: torch.Tensor,
        *,
        rand_seed: torch.Tensor,
    ) -> None:
        """state[dst] = state[src] advanced by its first n committed ring entries (Mamba2Mixer's contract)."""
        gdn_replay_materialize(
            cache.state[layer],
            *cache.ring(layer),
            cache.ring_start,
            cache.committed,
            src,
            num_entries,
            dst,
            rand_seed=rand_seed,
        )

    def _split(self, qkv: torch.Tensor, lead: tuple[int, ...]):
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(*lead, self.Hk, self.Dk),
            k.reshape(*lead, self.Hk, self.Dk),
            v.reshape(*lead, self.Hv, self.Dv),
        )

    def _prefill(self, qkv, g, beta, weight, ctx, seed: torch.Tensor) -> torch.Tensor:
        """Packed prefill tokens: conv from the slot's window, then the chunked form batched over rows from
        each slot's state (or zeros), cut at each prefix-cache boundary to take the exact state there."""
        md, cache, li = ctx.mamba, ctx.mamba_cache, self.mamba_index
        state = cache.state[li]
        if md.publish_dst is not None:
            Mamba2Mixer._publish_conv_windows(qkv, cache.conv[li], md)
        qkv = causal_conv1d_varlen(
            qkv,
            weight,
            None,
            cache.conv[li],
            md.prefill_cu_seqlens,
            md.prefill_slots,
            md.has_initial_state,
            activation="silu",
        )
        Tp = qkv.shape[0]
        q, k, v = self._split(qkv, (Tp,))
        cu = md.prefill_cu_seqlens.tolist()
        # Each row starts from its slot's state or zeros (a fill, so a fresh slot's stale NaN never leaks in).
        state0 = state[md.prefill_slots].float()
        state0.masked_fill_(~md.has_initial_state[:, None, None, None], 0.0)
        # Every row's final state goes to its slot, each boundary state to its publish_dst.
        points = [(i, cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]
        dst = md.prefill_slots
        if md.publish_dst is not None:
            points += list(zip(md.publish_seq.tolist(), md.publish_len.tolist()))
            dst = torch.cat([dst, md.publish_dst])
        out = torch.empty(Tp, self.Hv, self.Dv, dtype=qkv.dtype, device=qkv.device)
        _, states = gdn_chunked_varlen_ref(q, k, v, g, beta, cu, state0, points, out=out)
        # One write of every boundary and final state: distinct slots, one rounding draw.
        store_states(state, dst.long(), states, seed)
        return out

    def _decode(self, qkv, g, beta, weight, ctx, seed: torch.Tensor) -> torch.Tensor:
        """Decode rows padded to (b, q): conv update, then ReplaySSM or the baseline state update."""
        md, cache, li = ctx.mamba, ctx.mamba_cache, self.mamba_index
        b, q = md.num_decode_rows, md.decode_q
        if md.decode_token_index is not None:
            # Rows shorter than q get zero inputs in the tail; those are never committed (mamba2.py).
            grids = []
            for t in (qkv, g, beta):
                grid = t.new_zeros(b * q, *t.shape[1:])
                grid[md.decode_token_index] = t
                grids.append(grid)
            qkv, g, beta = grids
        qkv = qkv.reshape(b, q, self.conv_dim)
        qs = qkv.new_empty(b, q, self.key_dim)
        ks = qkv.new_empty(b, q, self.key_dim)
        vs = qkv.new_empty(b, q, self.value_dim)
        advance = md.advance_windows
        park = None if advance else cache.conv_scratch[li][:b, :q]
        causal_conv1d_update(
            qkv,
            weight,
            None,
            cache.conv[li],
            md.decode_slots,
            activation="silu",
            outs=(qs, ks, vs),
            inputs_out=park,
            advance_window=advance,
        )
        qh, kh = qs.view(b, q, self.Hk, self.Dk), ks.view(b, q, self.Hk, self.Dk)
        vh = vs.view(b, q, self.Hv, self.Dv)
        g, beta = g.reshape(b, q, self.Hv), beta.reshape(b, q, self.Hv)
        if ctx.replayssm:
            o = gdn_replay_forward(
                qh,
                kh,
                vh,
                g,
                beta,
                cache.state[li],
                *cache.ring(li),
                cache.ring_start,
                cache.committed,
                md.decode_slots,
                ctx.window,
                rand_seed=seed,
            )
        else:
            o = gdn_state_update(
                cache.state[li],
                qh,
                kh,
                vh,
                g,
                beta,
                md.decode_slots,
                dst_indices=md.decode_dst_slots,
                rand_seed=seed,
            )
        o = o.reshape(b * q, self.Hv, self.Dv)
        return o[md.decode_token_index] if md.decode_token_index is not None else o
