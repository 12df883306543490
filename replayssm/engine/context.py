"""ForwardContext: everything one forward pass needs besides the token ids.

Tokens are packed with prefill rows first, then decode rows (the runner reorders the engine's
rows and maps the logits back). Attention treats all rows alike (a query chunk on top of cached
context); the Mamba mixers split the packed tokens at `num_prefill_tokens`:

    packed tokens:  [ prefill row 0 | prefill row 1 | ... | decode row 0 | decode row 1 | ... ]
    attention:      one query chunk per row, causal over the row's cached context + itself
    mamba prefill:  varlen conv + chunked scan over the prefill rows (prefill_cu_seqlens)
    mamba decode:   rows padded to a (num_decode_rows, decode_q) grid; decode_token_index maps
                    packed decode tokens into that grid (None when every row has decode_q tokens)
    positions:      each token's absolute position in its request, start_pos + offset in the row
                    (rotary attention; the same position that addresses its K/V slot)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class DeviceSeeds:
    """The stochastic-rounding seeds of one runner, in device memory (see ops/rounding.py).

    Draw k rounds Mamba layer l with seed base + k * L + l (L layers). `seeds[l]` is layer l's seed
    as a one-element int64 tensor that the kernels read on the device; `advance()` moves every layer
    to the next draw with one in-place add on the device. A step ends with it, inside its CUDA graph
    when it replays one, so each replay rounds with fresh bits and a replayed step writes what the
    eager step with the same seed values writes. Each seed sits in its own 16-byte row: Triton
    specializes kernels on pointer alignment, and one alignment keeps one variant for every layer.
    """

    def __init__(self, seed: int, num_layers: int, device: torch.device) -> None:
        self.num_layers = max(num_layers, 1)
        base = (seed * 1_000_003) % (1 << 31)
        table = torch.zeros(self.num_layers, 2, dtype=torch.int64)
        table[:, 0] = base + torch.arange(self.num_layers)
        self.table = table.to(device)
        self._layers = [self.table[i, :1] for i in range(self.num_layers)]

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._layers[layer]

    def advance(self) -> None:
        """Every layer to the next draw (a device add: no host sync, captured in a graph)."""
        self.table.add_(self.num_layers)

    def values(self) -> list[int]:
        """The current seed of each layer (reads the device: tests and debugging only)."""
        return self.table[:, 0].tolist()


@dataclass
class AttentionMetadata:
    """Paged-attention addressing for the packed tokens (all rows, in packed order)."""

    slot_mapping: torch.Tensor  # (T,) int64: block * block_size + offset of each token's K/V
    cu_seqlens_q: torch.Tensor  # (n+1,) int32: query chunk boundaries
    block_tables: torch.Tensor  # (n, max_blocks) int32, -1 past each row's blocks
    context_lens: torch.Tensor  # (n,) int32: cached tokens per row after this step
    max_query_len: int
    max_context_len: int


@dataclass
class MambaMetadata:
    """Which packed tokens take the prefill path and which the decode path, and their slots."""

    num_prefill_tokens: int
    prefill_cu_seqlens: torch.Tensor  # (n_p+1,) int32, offsets inside the prefill tokens
    prefill_slots: torch.Tensor  # (n_p,) int32
    has_initial_state: torch.Tensor  # (n_p,) bool: continue from the slot (chunked prefill)
    num_decode_rows: int
    decode_q: int  # grid width: the longest decode row
    decode_slots: torch.Tensor  # (b,) int32: live slot of each decode row (source state)
    decode_token_index: torch.Tensor | None  # (T_d,) int64 positions in the flattened (b, q) grid
    decode_dst_slots: torch.Tensor | None  # (b, q) int32: baseline verify per-token state slots, -1 = skip
    # Prefix-cache checkpoints of prefill rows: state + conv window after publish_len[j] tokens of
    # prefill row publish_seq[j] go to slot publish_dst[j] (m,) (None: nothing to publish).
    publish_seq: torch.Tensor | None = None  # (m,) int32
    publish_len: torch.Tensor | None = None  # (m,) int32
    publish_dst: torch.Tensor | None = None  # (m,) int32

    @property
    def advance_windows(self) -> bool:
        """One-token decode rows, none with a baseline destination slot: each accepts its token
        (commit counts lie in [1, q]), so the decode conv update moves the windows itself and the
        commit leaves them alone (models/layers/mamba2.py, engine/decode_commit.py)."""
        return self.decode_q == 1 and self.decode_dst_slots is None and self.decode_token_index is None


@dataclass
class ForwardContext:
    """One step's metadata plus the cache tensors the layers read and write."""

    attn: AttentionMetadata
    mamba: MambaMetadata
    kv_cache: object  # replayssm.cache.mamba_cache.KVCache
    mamba_cache: object  # replayssm.cache.mamba_cache.MambaCache
    replayssm: bool
    window: int
    rand_seed: DeviceSeeds  # this step's stochastic-rounding seeds: layer l rounds with rand_seed[l]
    # (T,) int64: absolute 0-based position of each packed token in its request (cached prefix
    # included): a decode row with c computed tokens and k drafts holds c, c + 1, ..., c + k.
    positions: torch.Tensor | None = None
