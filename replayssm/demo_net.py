"""The demo model for training: a differentiable Nemotron-H (Mamba-2, attention, MLP) plus one MTP layer.

Plain PyTorch, batched (B, L, ...) and padded nowhere, with parameters named exactly as the
checkpoint (`backbone.*`, `lm_head.weight`, `mtp.*`), so `state_dict()` is the checkpoint and the
engine loads it as is. It is the training twin of replayssm/models (trunk) and
replayssm/speculative/mtp_model.py (MTP layer); tests/demo checks that the engine reproduces its
log-probabilities and MTP drafts, and that transformers' NemotronH reproduces its trunk. The Mamba-2
scan is the chunked SSD of mamba_ssm's ssd_minimal.py (einsum contractions: nothing of size
B x L x heads x head_dim x state is materialized), in fp32 also under bf16 autocast.

MTP depths: depth d at position p reads the token x_{p+1} and depth d-1's output at p - 1 (depth 1:
the trunk's normed output at p) and predicts x_{p+2}. This is how the engine drafts d_2, d_3, ...,
and the depth-d attention reads the keys the engine's MTP KV cache holds when it drafts: depth 1's
up to p - d + 1, then one key of each deeper level.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Nemotron-H's RMSNorm: normalize and weight in fp32, cast to the input dtype."""

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


def segsum(x: torch.Tensor) -> torch.Tensor:
    """x (..., T) -> (..., T, T): sum of x[j+1..i] at [i, j] for j <= i, -inf above the diagonal."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), -1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device)), -torch.inf)


def ssd(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk: int) -> torch.Tensor:
    """Chunked SSD from a zero state: x (b, l, h, p) already times dt, A (b, l, h) times dt,
    B and C (b, l, h, n); l a multiple of chunk. Returns y (b, l, h, p)."""
    b, l, h, p = x.shape
    c = l // chunk
    x, B, C = (t.reshape(b, c, chunk, h, -1) for t in (x, B, C))
    A = A.reshape(b, c, chunk, h).permute(0, 3, 1, 2)  # (b, h, c, chunk)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(segsum(A))  # (b, h, c, l, s)
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * L
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores, x)
    decay_states = torch.exp(A_cumsum[..., -1:] - A_cumsum)  # (b, h, c, l)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(A_cumsum[..., -1], (1, 0))))  # (b, h, c + 1, c + 1)
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    return (y_diag + y_off).reshape(b, l, h, p)


class Mamba2Mixer(nn.Module):
    """Nemotron-H's Mamba-2 mixer: in_proj -> [z, xBC, dt]; causal conv + silu on xBC; SSD; gated
    group RMSNorm; out_proj. Δ = softplus(dt + dt_bias) with no floor, as the engine computes it."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        h, self.nh, self.hd = c["hidden_size"], c["mamba_num_heads"], c["mamba_head_dim"]
        self.ng, self.n, self.chunk = c["n_groups"], c["ssm_state_size"], c["chunk_size"]
        self.eps = c["layer_norm_epsilon"]
        self.inner = self.nh * self.hd
        self.conv_dim = self.inner + 2 * self.ng * self.n
        self.in_proj = nn.Linear(h, self.inner + self.conv_dim + self.nh, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c["conv_kernel"], groups=self.conv_dim,
                                padding=c["conv_kernel"] - 1, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.nh))
        self.dt_bias = nn.Parameter(torch.zeros(self.nh))
        self.D = nn.Parameter(torch.ones(self.nh))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, h, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, l, _ = u.shape
        z, xbc, dt = self.in_proj(u).split([self.inner, self.conv_dim, self.nh], dim=-1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :l].transpose(1, 2))
        x, B, C = xbc.float().split([self.inner, self.ng * self.n, self.ng * self.n], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # (b, l, h)
        A = -torch.exp(self.A_log.float())
        pad = (-l) % self.chunk
        rep = self.nh // self.ng
        x = x.reshape(b, l, self.nh, self.hd)
        B = B.reshape(b, l, self.ng, self.n).repeat_interleave(rep, 2)
        C = C.reshape(b, l, self.ng, self.n).repeat_interleave(rep, 2)
        padded = [F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x * dt[..., None], A * dt, B, C)]
        with torch.autocast(u.device.type, enabled=False):  # the scan stays fp32 under bf16 autocast
            y = ssd(*padded, self.chunk)[:, :l] + self.D.float()[:, None] * x
        # Gated RMSNorm over each group's channels, in fp32, as transformers' NemotronHRMSNormGated.
        y = (y.reshape(b, l, self.inner) * F.silu(z.float())).reshape(b, l, self.ng, -1)
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(b, l, self.inner)
        return self.out_proj((self.norm.weight.float() * y).to(u.dtype))


class Attention(nn.Module):
    """Nemotron-H attention (GQA, no positional encoding); with an MTP KV list, over the MTP depths'
    keys (module docstring)."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        h, self.hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)

    def forward(self, x: torch.Tensor, kv: list | None = None) -> torch.Tensor:
        """x (B, L, hidden). kv: None for the trunk; for the MTP, depths 1..d-1's (k, v), and gets d's."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.nh, self.hd).transpose(1, 2)
        rep = self.nh // self.nkv
        k = self.k_proj(x).view(b, n, self.nkv, self.hd).transpose(1, 2).repeat_interleave(rep, 1)
        v = self.v_proj(x).view(b, n, self.nkv, self.hd).transpose(1, 2).repeat_interleave(rep, 1)
        if kv is not None:
            kv.append((k, v))
        d = 1 if kv is None else len(kv)
        if d == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # Query p reads depth d - o's key at p - o for o < d - 1, depth 1's keys at p - d + 1 and before.
            i = torch.arange(n, device=x.device)
            offset = i[:, None] - i[None, :]
            scale = self.hd ** -0.5
            scores = (q @ kv[0][0].transpose(-1, -2)) * scale
            for o in range(d - 1):
                scores = torch.where(offset == o, (q @ kv[d - 1 - o][0].transpose(-1, -2)) * scale, scores)
            probs = torch.softmax(scores.float().masked_fill(offset < 0, float("-inf")), -1).to(q.dtype)
            out = torch.where(offset >= d - 1, probs, 0) @ kv[0][1]
            for o in range(d - 1):
                out = out + torch.where(offset == o, probs, 0) @ kv[d - 1 - o][1]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.up_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x: torch.Tensor, kv=None) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


MIXERS = {"M": Mamba2Mixer, "*": Attention, "-": MLP, "attention": Attention, "mlp": MLP}


class Block(nn.Module):
    """h + mixer(norm(h)). As an MTP block, the first also owns the fusion (enorm, hnorm, eh_proj)
    and the last the closing norm."""

    def __init__(self, c: dict, kind: str, first: bool = False, last: bool = False) -> None:
        super().__init__()
        h, eps = c["hidden_size"], c["layer_norm_epsilon"]
        self.norm = RMSNorm(h, eps)
        self.mixer = MIXERS[kind](c)
        if first:
            self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
        if last:
            self.final_layernorm = RMSNorm(h, eps)

    def forward(self, h: torch.Tensor, kv: list | None = None) -> torch.Tensor:
        x = self.norm(h)
        return h + (self.mixer(x) if isinstance(self.mixer, Mamba2Mixer) else self.mixer(x, kv))


class Backbone(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c, kind) for kind in c["hybrid_override_pattern"])
        self.norm_f = RMSNorm(c["hidden_size"], c["layer_norm_epsilon"])


class MTPHead(nn.Module):
    """The MTP layer of mtp_model.py, for training: depth-d outputs for every position at once."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        kinds = c["mtp_layers_block_type"]
        self.layers = nn.ModuleList(Block(c, k, i == 0, i == len(kinds) - 1) for i, k in enumerate(kinds))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """embeds: embedding of x_{p+1} (B, L, hidden); hidden: the trunk's normed output at p. Returns
        the outputs (after final_layernorm) of depths 1..depth; depth d's row p predicts x_{p+2}."""
        first, kv = self.layers[0], [[] for _ in self.layers]
        outs: list[torch.Tensor] = []
        for d in range(depth):
            # Depth d + 1 reads depth d's output one position back (row 0 gets zeros; its loss is masked).
            h = hidden if d == 0 else F.pad(outs[-1][:, :-1], (0, 0, 1, 0))
            x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(h)], dim=-1))
            for layer, layer_kv in zip(self.layers, kv):
                x = layer(x, layer_kv)
            outs.append(self.layers[-1].final_layernorm(x))
        return outs


class DemoLM(nn.Module):
    """Trunk + LM head + MTP layer (sharing the trunk's embedding and LM head)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.mtp = MTPHead(config)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 style: N(0, 0.02) matrices, residual outputs scaled by 1 / sqrt(2 x layers); Mamba's
        A in [1, 16], Δ log-uniform in [1e-3, 1e-1], D = 1; norms 1, conv biases 0."""
        c = self.config
        std, depth = 0.02, len(c["hybrid_override_pattern"]) + len(c["mtp_layers_block_type"])
        with torch.no_grad():
            for name, p in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf == "A_log":
                    p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16, generator=generator)))
                elif leaf == "dt_bias":
                    dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1),
                                                                generator=generator))
                    p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
                elif leaf == "D" or "norm" in name:
                    p.fill_(1.0)
                elif leaf == "bias":
                    p.zero_()
                elif "conv1d" in name:
                    p.normal_(0.0, 1 / math.sqrt(p.shape[-1]), generator=generator)
                else:
                    out_proj = name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight"))
                    p.normal_(0.0, std / math.sqrt(2 * depth) if out_proj else std, generator=generator)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, L) -> the trunk's output after norm_f (B, L, hidden)."""
        h = self.backbone.embeddings(ids)
        for layer in self.backbone.layers:
            h = layer(h)
        return self.backbone.norm_f(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()

    def mtp_logits(self, ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """ids (B, L) -> logits of depths 1..depth at positions 0..L-2 (row p predicts x_{p+2})."""
        h = self.hidden(ids)
        return [self.logits(o) for o in self.mtp(self.backbone.embeddings(ids[:, 1:]), h[:, :-1], depth)]

    @torch.no_grad()
    def greedy(self, ids: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation of one prompt (full recompute each step, no stop tokens)."""
        seq = list(ids)
        device = self.lm_head.weight.device
        for _ in range(max_tokens):
            h = self.hidden(torch.tensor([seq], device=device))
            seq.append(int(self.logits(h[:, -1]).argmax(-1)))
        return seq[len(ids):]

    @classmethod
    def from_checkpoint(cls, path: str) -> DemoLM:
        """The training model with a checkpoint's weights (upcast to fp32), in eval mode."""
        from safetensors.torch import load_file

        with open(os.path.join(path, "config.json")) as f:
            model = cls(json.load(f))
        weights = load_file(os.path.join(path, "model.safetensors"))
        model.load_state_dict({k: t.float() for k, t in weights.items()}, strict=True)
        return model.eval()
