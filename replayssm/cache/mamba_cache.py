"""Cache tensors: per-slot Mamba state (checkpoint, conv window, ReplaySSM ring, cursors) and paged KV.

Per Mamba layer l, per slot s (S = num_slots + 1: the last slot is the runner's private scratch):

    state[l][s]   (H, P, N)          state dtype   checkpoint S_0
    conv[l][s]    (conv_dim, K-1)    act dtype     last K-1 committed conv inputs, oldest first
    ring_x[l][s]  (H, R, P)          act dtype     ReplaySSM only (R = W + q_max)
    ring_B[l][s]  (G, R, N)          act dtype     ReplaySSM only
    ring_dt[l][s] (H, R)             fp32 Δ        ReplaySSM only
    ring_start[s], committed[s]      int32         shared by all Mamba layers
    conv_scratch[l] (max_num_seqs, q_max, conv_dim)  this step's decode conv inputs (not per slot)

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
       (`set_null_history`; engine/model_runner.py says why and how j is chosen).
    *** a step whose rows each decode one token and keep it (`MambaMetadata.advance_windows`)
        advances the windows in its forward and skips the conv commit (engine/decode_commit.py).

KV cache, per attention layer: k, v (num_blocks, block_size, kv_heads, head_dim) in act dtype.
Everything is zero-initialized so an unused row never holds garbage (NaN * 0 = NaN).
"""

from __future__ import annotations

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


class MambaCache:
    """Per-layer Mamba slot tensors plus shared ring cursors (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, num_slots: int, act_dtype: torch.dtype, state_dtype: torch.dtype,
                 replayssm: bool, window: int, q_max: int, max_num_seqs: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # runner-private slot: never handed out by the engine
        S = num_slots + 1
        L = cfg.num_mamba_layers
        H, P, N, G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_n_groups
        self.ring_rows = window + q_max if replayssm else 0
        R = self.ring_rows
        z = dict(device=device)
        self.state = [torch.zeros(S, H, P, N, dtype=state_dtype, **z) for _ in range(L)]
        K1 = cfg.conv_kernel - 1
        self.conv = [torch.zeros(S, cfg.conv_dim, K1, dtype=act_dtype, **z) for _ in range(L)]
        self.ring_x = [torch.zeros(S, H, R, P, dtype=act_dtype, **z) for _ in range(L)]
        self.ring_B = [torch.zeros(S, G, R, N, dtype=act_dtype, **z) for _ in range(L)]
        self.ring_dt = [torch.zeros(S, H, R, dtype=torch.float32, **z) for _ in range(L)]
        self.ring_start = torch.zeros(S, dtype=torch.int32, **z)
        self.committed = torch.zeros(S, dtype=torch.int32, **z)
        self.conv_scratch = [torch.zeros(max_num_seqs, q_max, cfg.conv_dim, dtype=act_dtype, **z)
                             for _ in range(L)]

    def per_slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by slot on dim 0 (state, conv, ring of every layer, cursors)."""
        return [*self.state, *self.conv, *self.ring_x, *self.ring_B, *self.ring_dt,
                self.ring_start, self.committed]

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
        """committed = counts (for slots whose cursors are 0) over zeroed ring rows: Δ = 0 and x = B = 0,
        entries that change nothing (engine/model_runner.py, staggered checkpoints). Zeroing x and B
        too keeps a slot clear of whatever an earlier request left in its rows (0 * NaN = NaN)."""
        for t in (*self.ring_x, *self.ring_B, *self.ring_dt):
            t.index_fill_(0, slots, 0.0)
        self.committed[slots] = counts

    def reset_cursors(self, slots: torch.Tensor) -> None:
        """committed = ring_start = 0 for `slots` (after a prefill wrote a clean S_0)."""
        self.ring_start[slots] = 0
        self.committed[slots] = 0

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, *, act_dtype: torch.dtype, state_dtype: torch.dtype,
                       replayssm: bool, window: int, q_max: int) -> int:
        """Bytes one slot takes across all Mamba layers (state, conv, ring, cursors)."""
        H, P, N, G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_n_groups
        R = window + q_max if replayssm else 0
        a = _size(act_dtype)
        per_layer = (H * P * N * _size(state_dtype) + cfg.conv_dim * (cfg.conv_kernel - 1) * a
                     + H * R * P * a + G * R * N * a + H * R * 4)
        return cfg.num_mamba_layers * per_layer + 8

    @staticmethod
    def scratch_bytes(cfg: ModelConfig, *, act_dtype: torch.dtype, q_max: int, max_num_seqs: int) -> int:
        """Fixed bytes of the decode conv scratch (all layers)."""
        return cfg.num_mamba_layers * max_num_seqs * q_max * cfg.conv_dim * _size(act_dtype)


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
