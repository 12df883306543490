"""Vocabulary-parallel embedding and LM head (plain ones when tensor_parallel_size is 1).

Rank r holds rows [r * ceil(V / size), ...) of the embedding and of the LM head, zero padded to
ceil(V / size) rows. The embedding looks up the ids it holds, writes zeros for the others and
all-reduces (one nonzero term per token: exact). The LM head computes its slice of the logits
and all-gathers them along the vocabulary; the padding columns are cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayssm.distributed.parallel import SINGLE, TensorParallel
from replayssm.distributed.sharding import vocab_range


class VocabParallelEmbedding(nn.Module):
    """input_ids (T,) -> (T, hidden); weight (ceil(V / size), hidden) under the checkpoint name."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TensorParallel = SINGLE,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.stop, rows = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, device=device, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.start) & (input_ids < self.stop)
        h = F.embedding(torch.where(mine, input_ids - self.start, 0), self.weight)
        h = h * mine.unsqueeze(-1).to(h.dtype)
        return self.tp.all_reduce(h)


def parallel_logits(h: torch.Tensor, head: torch.Tensor | nn.Module, vocab_size: int,
                    tp: TensorParallel = SINGLE, *, fp32: bool = True) -> torch.Tensor:
    """h (n, hidden) @ this rank's vocab rows -> full logits (n, vocab_size) on every rank, in fp32
    (fp32=False: in the weight's dtype, for a caller that casts only the rows it keeps; the cast is
    exact, so the values are the same). head: the rows as a weight, the LM head's nn.Linear, or an
    FP8 LM head (layers/fp8_linear.py), which computes them in h.dtype."""
    if isinstance(head, nn.Linear):
        head = head.weight
    local = F.linear(h.to(head.dtype), head) if isinstance(head, torch.Tensor) else head(h)
    logits = tp.all_gather_last(local)[:, :vocab_size]
    return logits.float() if fp32 else logits
