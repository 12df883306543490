"""FP8 activation quantization in Triton (twin of `quantize_per_token_ref` / `quantize_static_ref` in
ops/fp8.py): one launch per call where the PyTorch path takes about seven elementwise kernels.

One program per row of x (M, K): read the row in its dtype, widen to fp32, take its amax, form the
scale max(amax, 1e-12) * fl(1 / 448) (dynamic) or read the per-tensor input scale (static), divide,
saturate to +-448, round to E4M3 and store the codes and the row's scale. Rows up to `_ONE_PASS_K`
wide stay in registers (one read of x); wider rows take a second pass over K, which L2 serves.

Bit-exact against the reference, on CUDA and under the interpreter: the division is `div_rn` (IEEE
round to nearest; Triton's `/` on fp32 is approximate on CUDA) and the E4M3 rounding is done on the bits
(`fp8_kv._e4m3_bits`), as the interpreter's float8 cast is wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE
from replayssm.ops.triton.fp8_kv import _e4m3_bits

_ONE_PASS_K = 8192  # widest row kept in registers: 32 fp32 a thread at 8 warps
_BLOCK_K = 4096  # chunk of a wider row per pass


@triton.jit
def _e4m3(x, scale, fp8_max):
    """fp32 x -> E4M3 codes (uint8) of x / scale, saturated to +-fp8_max."""
    y = tl.math.div_rn(x, scale)
    return _e4m3_bits(tl.minimum(tl.maximum(y, -fp8_max), fp8_max)).to(tl.uint8)


@triton.jit
def _quantize_rows_kernel(x_ptr, xq_ptr, scale_ptr, input_scale_ptr, K, stride_x, stride_q, min_scale,
                          inv_max, fp8_max, STATIC: tl.constexpr, ONE_PASS: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = xq_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(input_scale_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(x), axis=0), min_scale) * inv_max
        tl.store(scale_ptr + row, scale)
        tl.store(q_row + cols, _e4m3(x, scale, fp8_max), mask=mask)
    else:
        if STATIC:
            scale = tl.load(input_scale_ptr)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=0), min_scale) * inv_max
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            mask = k0 + cols < K
            x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + cols, _e4m3(x, scale, fp8_max), mask=mask)


def quantize_rows_triton(x: torch.Tensor, input_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16 / fp16 / fp32 -> (E4M3 (M, K), scales (M, 1) fp32): per-token scales, or with
    input_scale ((1,) fp32) every row's scale is it. The same bits as ops/fp8.py's references."""
    assert x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32), (x.dim(), x.dtype)
    assert input_scale is None or (input_scale.numel() == 1 and input_scale.dtype == torch.float32)
    M, K = x.shape
    assert K > 0, "an empty row has no amax"
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0:
        return xq, scale
    one_pass = K <= _ONE_PASS_K
    block = triton.next_power_of_2(K) if one_pass else _BLOCK_K
    # The static case reads its scale by pointer (no host read; a CUDA graph replays any later value).
    _quantize_rows_kernel[(M,)](x, xq.view(torch.uint8), scale, scale if input_scale is None else input_scale,
                                K, x.stride(0), K, MIN_SCALE, 1.0 / FP8_MAX, FP8_MAX,
                                STATIC=input_scale is not None, ONE_PASS=one_pass, BLOCK=block,
                                num_warps=8 if block >= 4096 else 4)
    return xq, scale
