"""relu² in Triton (twin of `ops/activation.py`): one read and one write per element.

The reference's two passes (relu, then square) cost the 8B-shaped decode step ~0.27 ms at batch 256
(24 MLP layers, (256, 21504) bf16 each); one pass moves half the bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _relu2_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    r = tl.maximum(x.to(tl.float32), 0.0)
    tl.store(y_ptr + offs, (r * r).to(x.dtype), mask=m)


def relu2_triton(x: torch.Tensor) -> torch.Tensor:
    """relu(x)² (`ops.activation.relu2`); arguments validated by the public op."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _relu2_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, BLOCK=BLOCK, num_warps=8)
    return y
