"""TensorParallel: this process's rank and the group size, plus the collectives of the model.

The model runs three collectives, all on the default process group (NCCL on CUDA, gloo on CPU):
  - all_reduce: one per block output (row-parallel projections leave partial sums), one after
    the vocab-parallel embedding, and one small sum of squares in the Mamba gated norm when a
    norm group spans ranks;
  - all_gather_last: the vocab-parallel LM head's logits, concatenated along the vocabulary.
A size-1 TensorParallel makes every collective a no-op, so single-GPU code pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    """rank in [0, size); size 1 means no tensor parallelism (no process group needed)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        # EngineConfig checks the user's tensor_parallel_size; the rank comes from the group start-up.
        assert self.size >= 1 and 0 <= self.rank < self.size, (self.rank, self.size)

    def check_group(self) -> None:
        """Raise unless the default process group matches (rank, size)."""
        if self.size == 1:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(f"tensor_parallel_size={self.size} needs an initialized process group "
                             "(use LLM(..., tensor_parallel_size=N) or torchrun)")
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.size):
            raise ValueError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                             f"expected rank {self.rank} of {self.size}")

    def split(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of n items (n divisible by size)."""
        assert n % self.size == 0, (n, self.size)
        share = n // self.size
        return self.rank * share, (self.rank + 1) * share

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place; returns x."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., n) on every rank -> (..., size * n), rank r's block at [r*n, (r+1)*n)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
