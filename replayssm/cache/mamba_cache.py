"""Cache tensors: per-slot recurrent state (checkpoint, conv window, ReplaySSM ring, cursors) and paged KV.

Every recurrent mixer keeps the same per-slot contract (docs/design.md, "The cache contract"); what
differs between mixers is only the shape of the state and the fields of a ring entry, which
`MixerCacheSpec` describes (`mixer_cache_spec(cfg)`):

    mixer            state           ring fields (per slot: (heads, R, width), or (heads, R) if width 0)
    Mamba-2          (H, P, N)       x (H, P) act, B (G, N) act, dt (H) fp32 (Δ after softplus)
    Gated DeltaNet   (Hv, Dk, Dv)    k (Hk, Dk) act, e (Hv, Dv) fp32 (the token's delta), g (Hv) fp32

Per recurrent layer l, per slot s (S = num_slots + 1: the last slot is the runner's private scratch):

    state[l][s]          state shape         state dtype   checkpoint S_0
    conv[l][s]           (conv_dim, K-1)     act dtype     last K-1 committed conv inputs, oldest first
    rings[l][name][s]    (heads, R, width)   see above     ReplaySSM only (R = W + q_max)
    ring_start[s], committed[s]              int32         shared by all recurrent layers
    conv_scratch[l] (max_num_seqs, q_max, conv_dim)  this step's decode conv inputs (not per slot)

`ring_x`, `ring_B`, `ring_dt` are the Mamba-2 ring fields of every layer (Mamba-2 models only).

What mutates when (one engine step):

    | phase            | state      | conv        | ring        | cursors          | scratch |
    |------------------|------------|-------------|-------------|------------------|---------|
    | prefill forward  | written    | written     | -           | reset to 0 first | -       |
    | 1st decode (**)  | -          | -           | zeroed      | committed = j    | -       |
    | decode forward   | flush only | read (***)  | appended    | read only        | written |
    | baseline decode  | written*   | read (***)  | -           | -                | written |
    | commit           | -          | advanced    | -           | moved (§2)       | read    |
    | copy_slots       | copied     | copied      | copied      | copied           | -       |

    * baseline verify writes the state after token t into spec slot t, never into the source.
    ** staggered checkpoints: before a slot's first decode forward after a prefill, j null entries
       (`set_null_history`; engine/model_runner.py says why and how j is chosen). A zeroed entry is a
       no-op entry for every mixer: Δ = 0 (Mamba-2), g = 0 and e = 0 (Gated DeltaNet).
    *** a step whose rows each decode one token and keep it (`MambaMetadata.advance_windows`)
        advances the windows in its forward and skips the conv commit (engine/decode_commit.py).

KV cache, per attention layer: k, v (num_blocks, block_size, kv_heads, head_dim) in act dtype.
Everything is zero-initialized so an unused row never holds garbage (NaN * 0 = NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayssm.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def as_dtype(value: str | torch.dtype, name: str) -> torch.dtype:
    """A torch dtype from a dtype or its name (float32, float16, bfloat16)."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"{name} must be one of {sorted(DTYPES)}, got {value!r}")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class RingField:
    """One field of a ring entry: per slot (heads, R, width), or (heads, R) when width is 0;
    activation dtype, or fp32 (`fp32`)."""

    name: str
    heads: int
    width: int
    fp32: bool = False


@dataclass(frozen=True)
class MixerCacheSpec:
    """What one recurrent layer keeps per slot: state shape, conv channels and kernel, ring fields."""

    state_shape: tuple[int, ...]
    conv_dim: int
    conv_kernel: int
    ring: tuple[RingField, ...]

    def bytes_per_slot(self, act: int, state: int, ring_rows: int) -> int:
        """Bytes of one slot of this layer, with element sizes `act` and `state`."""
        n = state
        for d in self.state_shape:
            n *= d
        n += self.conv_dim * (self.conv_kernel - 1) * act
        for f in self.ring:
            n += f.heads * ring_rows * max(f.width, 1) * (4 if f.fp32 else act)
        return n


def mixer_cache_spec(cfg: ModelConfig) -> MixerCacheSpec:
    """The cache description of `cfg`'s recurrent layers (all of one mixer kind)."""
    if cfg.num_gdn_layers:
        Hk, Hv, Dk, Dv = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
        # e: the delta each token adds (ops/gdn.py), computed once when its token is new; fp32 so
        # replaying it reproduces the baseline's fp32 recurrence. beta is folded into e, so the ring
        # keeps no copy of it.
        ring = (RingField("k", Hk, Dk), RingField("e", Hv, Dv, True), RingField("g", Hv, 0, True))
        return MixerCacheSpec((Hv, Dk, Dv), cfg.gdn_conv_dim, cfg.conv_kernel, ring)
    H, P, N, G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_n_groups
    ring = (RingField("x", H, P), RingField("B", G, N), RingField("dt", H, 0, True))
    return MixerCacheSpec((H, P, N), cfg.conv_dim, cfg.conv_kernel, ring)


class MambaCache:
    """Per-layer recurrent slot tensors plus shared ring cursors (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, num_slots: int, act_dtype: torch.dtype, state_dtype: torch.dtype,
                 replayssm: bool, window: int, q_max: int, max_num_seqs: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # runner-private slot: never handed out by the engine
        S = num_slots + 1
        L = cfg.num_recurrent_layers
        self.spec = spec = mixer_cache_spec(cfg)
        self.ring_rows = window + q_max if replayssm else 0
        R = self.ring_rows
        z = dict(device=device)
        self.state = [torch.zeros(S, *spec.state_shape, dtype=state_dtype, **z) for _ in range(L)]
        K1 = spec.conv_kernel - 1
        self.conv = [torch.zeros(S, spec.conv_dim, K1, dtype=act_dtype, **z) for _ in range(L)]

        def field(f: RingField) -> torch.Tensor:
            shape = (S, f.heads, R, f.width) if f.width else (S, f.heads, R)
            return torch.zeros(shape, dtype=torch.float32 if f.fp32 else act_dtype, **z)

        self.rings = [{f.name: field(f) for f in spec.ring} for _ in range(L)]
        self.ring_start = torch.zeros(S, dtype=torch.int32, **z)
        self.committed = torch.zeros(S, dtype=torch.int32, **z)
        self.conv_scratch = [torch.zeros(max_num_seqs, q_max, spec.conv_dim, dtype=act_dtype, **z)
                             for _ in range(L)]

    def ring(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s ring fields in the spec's order (the order the mixer's ops take them)."""
        return tuple(self.rings[layer][f.name] for f in self.spec.ring)

    @property
    def ring_x(self) -> list[torch.Tensor]:
        return [r["x"] for r in self.rings]

    @property
    def ring_B(self) -> list[torch.Tensor]:
        return [r["B"] for r in self.rings]

    @property
    def ring_dt(self) -> list[torch.Tensor]:
        return [r["dt"] for r in self.rings]

    def _ring_tensors(self) -> list[torch.Tensor]:
        return [r[f.name] for f in self.spec.ring for r in self.rings]

    def per_slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by slot on dim 0 (state, conv, ring of every layer, cursors)."""
        return [*self.state, *self.conv, *self._ring_tensors(), self.ring_start, self.committed]

    def copy_slots(self, src: list[int], dst: list[int], *, ring: bool = True) -> None:
        """slot dst[i] <- slot src[i]: state, conv, ring and cursors. dst distinct and not in src.

        ring=False leaves dst's ring rows as they are: only for sources without committed ring
        entries (a prefix checkpoint), whose ring rows are never read (cursors 0 are copied).
        One multi-tensor copy of whole-slot views: a per-tensor gather + scatter takes 102 launches and
        5.4 ms of host time per copied slot (24 layers) in the H200 prefix-hit profile.
        """
        tensors = self.per_slot_tensors()
        if not ring:
            tensors = [*self.state, *self.conv, self.ring_start, self.committed]
        pairs = list(zip(src, dst))
        dsts = [t[d] for t in tensors for _, d in pairs]
        srcs = [t[s] for t in tensors for s, _ in pairs]
        torch._foreach_copy_(dsts, srcs)

    def set_null_history(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """committed = counts (for slots whose cursors are 0) over zeroed ring rows: entries that change
        nothing (Δ = 0 for Mamba-2, g = 0 and e = 0 for Gated DeltaNet; engine/model_runner.py, staggered
        checkpoints). Zeroing every field keeps a slot clear of whatever an earlier request left in its
        rows (0 * NaN = NaN)."""
        for t in self._ring_tensors():
            t.index_fill_(0, slots, 0.0)
        self.committed[slots] = counts

    def reset_cursors(self, slots: torch.Tensor) -> None:
        """committed = ring_start = 0 for `slots` (after a prefill wrote a clean S_0)."""
        self.ring_start[slots] = 0
        self.committed[slots] = 0

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, *, act_dtype: torch.dtype, state_dtype: torch.dtype,
                       replayssm: bool, window: int, q_max: int) -> int:
        """Bytes one slot takes across all recurrent layers (state, conv, ring, cursors)."""
        if not cfg.num_recurrent_layers:
            return 8
        R = window + q_max if replayssm else 0
        per_layer = mixer_cache_spec(cfg).bytes_per_slot(_size(act_dtype), _size(state_dtype), R)
        return cfg.num_recurrent_layers * per_layer + 8

    @staticmethod
    def scratch_bytes(cfg: ModelConfig, *, act_dtype: torch.dtype, q_max: int, max_num_seqs: int) -> int:
        """Fixed bytes of the decode conv scratch (all layers)."""
        if not cfg.num_recurrent_layers:
            return 0
        conv_dim = mixer_cache_spec(cfg).conv_dim
        return cfg.num_recurrent_layers * max_num_seqs * q_max * conv_dim * _size(act_dtype)


class KVCache:
    """Paged K and V per attention layer: (num_blocks, block_size, kv_heads, head_dim) each."""

    def __init__(self, cfg: ModelConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_attention_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_attention_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, *, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one KV block takes across all attention layers (K and V)."""
        per_layer = block_size * cfg.num_key_value_heads * cfg.head_dim * _size(dtype)
        return 2 * cfg.num_attention_layers * per_layer
