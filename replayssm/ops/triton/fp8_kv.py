"""Fused FP8 KV store in Triton (twin of `store_kv` in ops/attention.py for an E4M3 cache).

One program per token writes that token's K and V rows: load in the model dtype, multiply by the
layer's 1 / scale in fp32 (the reference's product), saturate to +-448, round to E4M3 and store at
the token's flat slot of the paged cache. The reference takes six elementwise and two scatter
kernels per layer; this is one launch.

The E4M3 rounding is done on the bits (`_e4m3_bits`, round to nearest even, as torch's cast), so
the kernel is bit-exact against the reference under the interpreter too, whose float8 cast is not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayssm.ops.fp8_format import FP8_DTYPE, FP8_MAX


@triton.jit
def _e4m3_bits(x):
    """fp32 x with |x| <= 448 -> its E4M3 code (uint8 values in int32), round to nearest even.

    |x| >= 2^-6 (E4M3 normals): round the fp32 mantissa to 3 bits on the integer bits and rebias the
    exponent (127 -> 7). Below: E4M3 subnormals are multiples of 2^-9; adding 2^14 (whose fp32 ulp is
    2^-9) rounds |x| to one in hardware, and the low bits of the sum count them (8 when it rounds up to
    2^-6, which is that normal's code)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    ab = a.to(tl.int32, bitcast=True)
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    sub = (a + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    return sign | tl.where(a >= 0.015625, normal, sub)


@triton.jit
def _store_kv_fp8_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, sk_t, sk_h, sv_t, sv_h,
                         k_inv, v_inv, fp8_max, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    h, d = i // D, i % D
    m = (i < H * D) & (slot + 0 * i >= 0)  # a negative slot writes nothing
    dst = slot * (H * D) + i
    k = tl.load(k_ptr + t * sk_t + h * sk_h + d, mask=m, other=0.0).to(tl.float32)
    k = tl.minimum(tl.maximum(k * k_inv, -fp8_max), fp8_max)
    tl.store(k_cache_ptr + dst, _e4m3_bits(k).to(tl.uint8), mask=m)
    v = tl.load(v_ptr + t * sv_t + h * sv_h + d, mask=m, other=0.0).to(tl.float32)
    v = tl.minimum(tl.maximum(v * v_inv, -fp8_max), fp8_max)
    tl.store(v_cache_ptr + dst, _e4m3_bits(v).to(tl.uint8), mask=m)


def store_kv_fp8_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Same contract as `store_kv` for an E4M3 cache (shapes checked there); k, v may be strided views
    with contiguous head_dim (slices of a fused qkv projection)."""
    T, H, D = k.shape
    assert k_cache.dtype == FP8_DTYPE and v_cache.dtype == FP8_DTYPE, k_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if T == 0:
        return
    # 1 / scale in double, rounded to fp32 at the launch: the scalar the reference multiplies by.
    _store_kv_fp8_kernel[(T,)](k, v, k_cache.view(torch.uint8), v_cache.view(torch.uint8), slot_mapping,
                               k.stride(0), k.stride(1), v.stride(0), v.stride(1), 1.0 / k_scale,
                               1.0 / v_scale, FP8_MAX, H=H, D=D, BLOCK=triton.next_power_of_2(H * D))
