"""Mamba-2 mixer over pooled per-slot state (Nemotron-H and pure Mamba-2 share it).

Tokens arrive packed, prefill rows first, then decode rows (see engine/context.py):

    in_proj -> [z (H*P) | xBC (conv_dim = H*P + 2*G*N) | dt (H)]
    prefill tokens: causal_conv1d_varlen -> ssd_chunked_scan   (writes clean S_0 and conv window;
                    prefix-cache checkpoints: the scan's exact state at a boundary + the K-1 conv
                    inputs before it go to a checkpoint slot)
    decode rows:    causal_conv1d_update (window unchanged; inputs parked in the conv scratch
                    for the commit) -> replay_forward (ReplaySSM) | selective_state_update (off)
    -> rms_norm_gated(y, z) -> out_proj

Under tensor parallelism the mixer holds its rank's heads and groups (distributed/sharding.py);
out_proj's output is a partial sum that the block all-reduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayssm.distributed.parallel import SINGLE, TensorParallel
from replayssm.distributed.sharding import MambaShard
from replayssm.models.config import ModelConfig
from replayssm.models.layers.conv_windows import conv_window_sources
from replayssm.ops.conv1d import causal_conv1d_update, causal_conv1d_varlen
from replayssm.ops.norm import rms_norm_gated
from replayssm.ops.replay import replay_forward, replay_materialize
from replayssm.ops.ssd import ssd_chunked_scan
from replayssm.ops.ssu import selective_state_update


class GatedNormWeight(nn.Module):
    """Holds the gated RMSNorm weight under the checkpoint's name (`mixer.norm.weight`)."""

    def __init__(self, size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype))


class Mamba2Mixer(nn.Module):
    """x (T, hidden) -> (T, hidden); reads and writes the layer's slots in ctx.mamba_cache."""

    def __init__(self, cfg: ModelConfig, mamba_index: int, *, device=None, dtype=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.mamba_index = mamba_index  # which per-layer Mamba cache tensors this layer owns
        self.tp, self.shard = tp, MambaShard.of(cfg, tp)
        # Local sizes: this rank's heads and groups (everything when tp.size == 1).
        self.H, self.P = cfg.mamba_num_heads // tp.size, cfg.mamba_head_dim
        self.G, self.N = self.shard.groups[1] - self.shard.groups[0], cfg.ssm_state_size
        self.I = self.H * self.P
        self.conv_dim = self.I + 2 * self.G * self.N
        self.chunk_size = cfg.chunk_size
        self.eps = cfg.norm_eps
        self.in_proj = nn.Linear(cfg.hidden_size, self.I + self.conv_dim + self.H, bias=cfg.mamba_proj_bias,
                                 device=device, dtype=dtype)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.use_conv_bias, device=device, dtype=dtype)
        # SSM parameters stay fp32 whatever the model dtype (the op API takes them fp32).
        self.A_log = nn.Parameter(torch.empty(self.H, device=device, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.H, device=device, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.H, device=device, dtype=torch.float32))
        self.norm = GatedNormWeight(self.I, device=device, dtype=dtype)
        self.out_proj = nn.Linear(self.I, cfg.hidden_size, bias=cfg.mamba_proj_bias,
                                  device=device, dtype=dtype)

    def forward(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        z, xBC, dt = self.in_proj(hidden).split([self.I, self.conv_dim, self.H], dim=-1)
        A = self.decay_A()
        weight = self.conv1d.weight[:, 0, :]
        md = ctx.mamba
        Tp = md.num_prefill_tokens
        seed = ctx.rand_seed[self.mamba_index]  # a device tensor (engine/context.py: DeviceSeeds)
        parts = []
        if Tp:
            parts.append(self._prefill(xBC[:Tp], dt[:Tp], A, weight, ctx, seed))
        if md.num_decode_rows:
            parts.append(self._decode(xBC[Tp:], dt[Tp:], A, weight, ctx, seed))
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        y = self._gated_norm(y, z)
        return self.out_proj(y.to(hidden.dtype))

    def materialize(self, cache, layer: int, src: torch.Tensor, num_entries: torch.Tensor,
                    dst: torch.Tensor, *, rand_seed: torch.Tensor) -> None:
        """state[dst] = state[src] advanced by its first n committed ring entries (int32 (m,) each):
        the recurrent mixers' one cache operation beyond the shared contract (engine/publish.py)."""
        replay_materialize(self.decay_A(), cache.state[layer], *cache.ring(layer), cache.ring_start,
                           cache.committed, src, num_entries, dst, rand_seed=rand_seed)

    def decay_A(self) -> torch.Tensor:
        """A = -exp(A_log), recomputed only when A_log changed (its version counter moves on every
        in-place write, e.g. a weight load): two launches fewer per layer and step. The result is
        rewritten in place, so a captured CUDA graph reads the new values too. Inference tensors
        keep no version counter: for them it is computed on every call."""
        a_log = self.A_log.detach()
        if a_log.is_inference():
            return -torch.exp(a_log.float())
        key = (a_log.data_ptr(), a_log.device, a_log._version)
        cached = getattr(self, "_A_cache", None)
        if cached is None or cached[0][:2] != key[:2]:
            self._A_cache = (key, -torch.exp(a_log.float()))
        elif cached[0] != key:
            torch.exp(a_log.float(), out=cached[1]).neg_()
            self._A_cache = (key, cached[1])
        return self._A_cache[1]

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """rms_norm_gated over I / G channels; a group split across ranks sums its squares over them."""
        sh = self.shard
        if sh.norm_group is None:
            return rms_norm_gated(y, z, self.norm.weight, self.eps, sh.norm_group_size)
        g = y.float() * F.silu(z.float())
        # One column per global group so that ranks sharing a group add up and others stay apart.
        sq = g.new_zeros(g.shape[0], sh.num_norm_groups)
        sq[:, sh.norm_group] = g.pow(2).sum(-1)
        self.tp.all_reduce(sq)
        g = g * torch.rsqrt(sq[:, sh.norm_group:sh.norm_group + 1] / sh.norm_group_size + self.eps)
        return self.norm.weight * g.to(y.dtype)

    def _split(self, xbc: torch.Tensor, lead: tuple[int, ...]):
        # Contiguous copies: the Triton kernels index x, B and C with dense strides.
        x, B, C = xbc.split([self.I, self.G * self.N, self.G * self.N], dim=-1)
        return (x.reshape(*lead, self.H, self.P).contiguous(), B.reshape(*lead, self.G, self.N).contiguous(),
                C.reshape(*lead, self.G, self.N).contiguous())

    def _prefill(self, xbc, dt, A, weight, ctx, seed: torch.Tensor) -> torch.Tensor:
        """Packed prefill tokens (Tp, ...): conv from the slot's window, chunked scan from its state."""
        md, cache, li = ctx.mamba, ctx.mamba_cache, self.mamba_index
        Tp = xbc.shape[0]
        if md.publish_dst is not None:
            self._publish_conv_windows(xbc, cache.conv[li], md)
        xbc = causal_conv1d_varlen(xbc, weight, self.conv1d.bias, cache.conv[li],
                                   md.prefill_cu_seqlens, md.prefill_slots, md.has_initial_state,
                                   activation="silu")
        x, B, C = self._split(xbc, (Tp,))
        # Checkpoint states go straight into their slots (boundary_dst).
        y, _ = ssd_chunked_scan(x, dt.contiguous(), A, B, C, self.D, self.dt_bias, cache.state[li],
                                md.prefill_cu_seqlens, md.prefill_slots, md.has_initial_state,
                                chunk_size=self.chunk_size, rand_seed=seed, boundary_seq=md.publish_seq,
                                boundary_len=md.publish_len, boundary_dst=md.publish_dst)
        return y.reshape(Tp, self.I)

    @staticmethod
    def _publish_conv_windows(xbc: torch.Tensor, conv: torch.Tensor, md) -> None:
        """conv[publish_dst[j]] = the K-1 raw conv inputs before token publish_len[j] of its prefill row:
        from the row's tokens, or (near the row start) from the slot's window (zeros without one).
        Runs before the varlen conv overwrites the row's window."""
        src = conv_window_sources(md, conv.shape[2])
        tok = xbc[src.token].transpose(1, 2)  # (m, D, K-1)
        if src.window_col is None:  # every boundary has K-1 tokens of its row before it
            conv[md.publish_dst] = tok.to(conv.dtype)
            return
        win = conv[src.window_slot]  # (m, D, K-1), oldest first
        win = win.gather(2, src.window_col.expand(-1, win.shape[1], -1))
        win = torch.where(src.has_window, win, torch.zeros((), dtype=win.dtype, device=win.device))
        conv[md.publish_dst] = torch.where(src.from_token, tok.to(conv.dtype), win)

    def _decode(self, xbc, dt, A, weight, ctx, seed: torch.Tensor) -> torch.Tensor:
        """Decode rows padded to (b, q): conv update, then ReplaySSM or the baseline state update."""
        md, cache, li = ctx.mamba, ctx.mamba_cache, self.mamba_index
        b, q = md.num_decode_rows, md.decode_q
        if md.decode_token_index is not None:
            # Rows shorter than q get zero inputs in the tail; those outputs are dropped and
            # those inputs are never committed (num_accepted <= the row's real length). The flush
            # test (h + q > W) and the commit see the step's q, so such a row flushes where h + q > W
            # even if h + its own length <= W: a fold earlier than it needs (one more state write,
            # and one more rounding for 16-bit state), the same outputs; DESIGN §2 holds for the
            # padded row.
            grid = xbc.new_zeros(b * q, self.conv_dim)
            grid[md.decode_token_index] = xbc
            dt_grid = dt.new_zeros(b * q, self.H)
            dt_grid[md.decode_token_index] = dt
            xbc, dt = grid, dt_grid
        xbc = xbc.reshape(b, q, self.conv_dim)  # a view: rows keep the projection's stride
        dt = dt.reshape(b, q, self.H)  # a strided view: the kernels take dt's strides
        # One launch reads the projection in place, writes x, B and C as separate dense tensors and
        # either parks the raw inputs in the conv scratch (the commit advances the window from them)
        # or, when every row accepts its one token, advances the window itself.
        x = xbc.new_empty(b, q, self.H, self.P)
        B = xbc.new_empty(b, q, self.G, self.N)
        C = xbc.new_empty(b, q, self.G, self.N)
        GN = self.G * self.N
        outs = (x.view(b, q, self.I), B.view(b, q, GN), C.view(b, q, GN))
        advance = md.advance_windows
        park = None if advance else cache.conv_scratch[li][:b, :q]
        causal_conv1d_update(xbc, weight, self.conv1d.bias, cache.conv[li], md.decode_slots,
                             activation="silu", outs=outs, inputs_out=park, advance_window=advance)
        if ctx.replayssm:
            y = replay_forward(x, dt, A, B, C, self.D, self.dt_bias, cache.state[li], cache.ring_x[li],
                               cache.ring_B[li], cache.ring_dt[li], cache.ring_start, cache.committed,
                               md.decode_slots, ctx.window, rand_seed=seed)
        else:
            y = selective_state_update(cache.state[li], x, dt, A, B, C, self.D, self.dt_bias, md.decode_slots,
                                       dst_indices=md.decode_dst_slots, rand_seed=seed)
        y = y.reshape(b * q, self.I)
        return y[md.decode_token_index] if md.decode_token_index is not None else y
