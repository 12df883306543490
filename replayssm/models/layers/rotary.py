"""Rotary position embedding (RoPE), the Llama / GPT-NeoX form: rotate_half, not interleaved.

Channel pairs (i, i + r/2) of the first r = rotary_dim channels of every head turn by the angle
pos * base^(-2i/r); channels past r pass through (partial rotary, transformers'
`partial_rotary_factor`):

    o[i]       = x[i] * cos - x[i + r/2] * sin        i < r/2
    o[i + r/2] = x[i + r/2] * cos + x[i] * sin
    o[j]       = x[j]                                  j >= r

The angles follow transformers' formula step by step (fp32 inverse frequencies, one fp32
product with the position, fp32 cos/sin), so the tables hold the values transformers computes.
The rotation runs in fp32 (or the input's wider float) and is cast back.

The cos/sin tables (max_position, r/2) are built once per (r, base, max_position, device) and
shared by every layer that uses them: a hybrid with rotary attention in each of dozens of layers
holds one table, not dozens. A layer keeps its table alive; it is built on the first forward on a
device (models are built on the meta device, then filled), before any CUDA graph capture (the
capture's warm-up runs the forward first).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from replayssm.models.config import ModelConfig

# (rotary_dim, base, max_position, device) -> cos/sin table (max_position, rotary_dim): [cos | sin]
_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _table(rotary_dim: int, base: float, max_position: int, device: torch.device) -> torch.Tensor:
    key = (rotary_dim, base, max_position, device)
    table = _TABLES.get(key)
    if table is None:
        # transformers: inv_freq = 1 / base^(arange(0, r, 2) / r); freqs = pos.float() * inv_freq
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
                                   / rotary_dim))
        freqs = torch.arange(max_position, device=device).float()[:, None] * inv_freq[None, :]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        _TABLES[key] = table
    return table


class RotaryEmbedding(nn.Module):
    """(positions (T,) int64, q (T, heads, D), k (T, kv_heads, D)) -> rotated (q, k), same dtypes.

    positions are absolute (0-based) token positions in their sequences and must lie in
    [0, max_position). No parameters or buffers: the module adds nothing to a state dict.
    """

    def __init__(self, head_dim: int, rotary_dim: int | None = None, base: float = 10000.0,
                 max_position: int = 4096, device=None, rope_scaling: dict | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        if base <= 0:
            raise ValueError(f"rope_theta must be > 0, got {base}")
        if max_position < 1:
            raise ValueError(f"max_position_embeddings must be >= 1, got {max_position}")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type")) if isinstance(rope_scaling, dict) \
                else rope_scaling
            if kind != "default":
                raise ValueError(f"rope_scaling type {kind!r} is not supported (only unscaled RoPE: "
                                 f"rope_scaling null or rope_type 'default')")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.base, self.max_position = float(base), max_position
        self._cos_sin: torch.Tensor | None = None
        if device is not None and torch.device(device).type != "meta":
            self._cos_sin = _table(rotary_dim, self.base, max_position, torch.device(device))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, " \
               f"max_position={self.max_position}"

    def cos_sin(self, device: torch.device) -> torch.Tensor:
        """The (max_position, rotary_dim) [cos | sin] table on `device` (built once, then shared)."""
        if self._cos_sin is None or self._cos_sin.device != device:
            self._cos_sin = _table(self.rotary_dim, self.base, self.max_position, device)
        return self._cos_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert positions.dim() == 1 and positions.shape[0] == q.shape[0] == k.shape[0], \
            (positions.shape, q.shape, k.shape)
        assert q.shape[-1] == k.shape[-1] == self.head_dim, (q.shape, k.shape, self.head_dim)
        half = self.rotary_dim // 2
        cos_sin = self.cos_sin(q.device).index_select(0, positions)[:, None, :]  # (T, 1, r)
        cos, sin = cos_sin[..., :half], cos_sin[..., half:]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half, r = self.rotary_dim // 2, self.rotary_dim
        dtype = torch.promote_types(x.dtype, torch.float32)
        x1, x2 = x[..., :half].to(dtype), x[..., half:r].to(dtype)
        cos, sin = cos.to(dtype), sin.to(dtype)
        out = torch.empty_like(x)
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:r] = x2 * cos + x1 * sin
        if r < self.head_dim:
            out[..., r:] = x[..., r:]
        return out


def rotary_for(cfg: ModelConfig, device=None) -> RotaryEmbedding | None:
    """The attention layers' rotary embedding of `cfg` (None: no positional encoding, rope_theta 0)."""
    if cfg.rope_theta <= 0:
        return None
    return RotaryEmbedding(cfg.head_dim, cfg.rotary_dim or None, cfg.rope_theta, cfg.max_model_len,
                           device=device)
