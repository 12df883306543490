"""Gated DeltaNet decode ops in Triton: the entry points `ops/gdn.py` dispatches to on CUDA.

Each `<op>_triton` has the signature and contract of `ops/gdn.py: <op>_ref` (arguments validated by
the public op). The kernels live in `gdn_state.py` (baseline state update, its tile table `CONFIGS`,
shared jitted helpers) and `gdn_replay.py` (ReplaySSM forward with flush over a ring of deltas,
materialize; their tile table `REPLAY_CONFIGS` is here); all three run one program per
(Dv tile, value head, row). Each entry point looks its tile up once per call by (state dtype, n > 1).
"""

from __future__ import annotations

import torch

from replayssm.ops.triton.gdn_replay import launch_materialize, launch_replay_forward
from replayssm.ops.triton.gdn_state import CONFIGS, LaunchConfig, launch_state_update

# The replay kernels' tile per (state dtype, several tokens per row); `gdn_state.py: CONFIGS` holds the
# state update's. Materialize folds ring entries and stores once, as a one-token row: (dtype, False).
REPLAY_CONFIGS = {
    # The H100 sweep (Qwen3.5-27B shape, batch 256; bench_gdn_kernels.py --sweep 32x4,64x4,64x8): 64
    # columns at 4 warps share the per-program key products (new keys and queries against the ring's
    # keys) and the new tokens' substitution over 64 state columns, and a (Dk, 64) fp32 tile reads a
    # slot's rows in 256-byte runs, as the state update's best tile does.
    (torch.float32, False): LaunchConfig(block_v=64, num_warps=4),  # 506 us against 823 at 32x4
    (torch.float32, True): LaunchConfig(block_v=64, num_warps=4),  # 711 us against 970 at 32x4
    (torch.float16, False): LaunchConfig(block_v=64, num_warps=4),  # bf16's tile: the same products
    (torch.float16, True): LaunchConfig(block_v=64, num_warps=4),
    (torch.bfloat16, False): LaunchConfig(block_v=64, num_warps=4),  # 440 us against 694 at 32x4
    (torch.bfloat16, True): LaunchConfig(block_v=64, num_warps=4),  # 547 us against 967 at 32x4
}


def gdn_state_update_triton(state, q, k, v, g, beta, state_indices, *,
                            dst_indices: torch.Tensor | None = None, rand_seed: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Baseline decode / verify (`ops.gdn.gdn_state_update`). With dst_indices, a row's destinations may
    include its own source (a program reads its tile before writing it) but no other row's source."""
    return launch_state_update(state, q, k, v, g, beta, state_indices, dst_indices, rand_seed, out,
                               CONFIGS[state.dtype, q.shape[1] > 1])


def gdn_replay_forward_triton(q, k, v, g, beta, state, ring_k, ring_e, ring_g, ring_start, committed,
                              state_indices, window: int, *, rand_seed: torch.Tensor | None = None,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """ReplaySSM decode / verify step (`ops.gdn.gdn_replay_forward`)."""
    return launch_replay_forward(q, k, v, g, beta, state, ring_k, ring_e, ring_g, ring_start, committed,
                                 state_indices, window, rand_seed, out,
                                 REPLAY_CONFIGS[state.dtype, q.shape[1] > 1])


def gdn_replay_materialize_triton(state, ring_k, ring_e, ring_g, ring_start, committed, src_indices,
                                  num_entries, dst_indices, *, rand_seed: torch.Tensor | None = None) -> None:
    """state[dst] = state[src] advanced by n ring entries (`ops.gdn.gdn_replay_materialize`)."""
    launch_materialize(state, ring_k, ring_e, ring_g, ring_start, src_indices, num_entries, dst_indices,
                       rand_seed, REPLAY_CONFIGS[state.dtype, False])
