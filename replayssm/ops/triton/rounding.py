"""Seeded stochastic rounding as a Triton device function (twin of `ops/rounding.py`).

`stochastic_round(x, offsets, seed_mix, DTYPE)` follows `stochastic_round_ref` step by step, so
the same fp32 value bound for the same pool element rounds to the same bits in both. The host
passes `seed_mix = (seed * 0x9E3779B9) mod 2^32` (see `seed_mix`), and the kernel adds the
element's linear offset in the destination pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def seed_mix(seed: int) -> int:
    """(seed * 0x9E3779B9) mod 2^32, the per-call part of the random bits."""
    return (int(seed) * _GOLDEN) & _MASK32


def tl_dtype(dtype):
    """The Triton dtype of a torch float dtype."""
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def max_finite(dtype) -> float:
    """Largest finite value of a Triton float dtype (fp32 returns its own max; it never rounds)."""
    if dtype == tl.float16:
        return 65504.0
    if dtype == tl.bfloat16:
        return 3.3895313892515355e38
    return 3.4028234663852886e38


@triton.jit
def random_uniform(offsets, seed_mix):
    """r in [0, 1) (fp32) from lowbias32 of (seed_mix + offset) mod 2^32; offsets int64."""
    # uint32 arithmetic wraps mod 2^32 and shifts logically, exactly as the recipe needs.
    v = (offsets + seed_mix).to(tl.uint32)
    v = v ^ (v >> 16)
    v = v * 0x7FEB352D
    v = v ^ (v >> 15)
    v = v * 0x846CA68B
    v = v ^ (v >> 16)
    return (v >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def stochastic_round(x, offsets, seed_mix, DTYPE: tl.constexpr, MAXV: tl.constexpr):
    """Round fp32 `x` to DTYPE (fp16/bf16) stochastically; fp32 passes through unchanged.

    offsets: int64, x's shape, the element's linear index in the destination pool.
    """
    out = x
    if DTYPE != tl.float32:
        r = random_uniform(offsets.to(tl.int64), seed_mix)
        mag = tl.abs(x)
        # Round to nearest, step one code toward zero if that overshot: truncation. The
        # magnitudes are non-negative, so +-1 on the bit pattern moves by one ulp.
        near = mag.to(DTYPE)
        bits = near.to(tl.int16, bitcast=True).to(tl.int32)
        bits = tl.where(near.to(tl.float32) > mag, bits - 1, bits)
        d = bits.to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
        u = (bits + 1).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
        p = (mag - d) / (u - d)
        rounded = tl.where((mag != d) & (r < p), u, d)
        rounded = tl.where(mag > MAXV, MAXV, rounded)
        # Copy x's sign bit onto the low-precision pattern (keeps -0.0 like copysign).
        sign = (x.to(tl.int32, bitcast=True) >> 16) & 0x8000
        obits = rounded.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) | sign
        res = obits.to(tl.int16).to(DTYPE, bitcast=True)
        out = tl.where(x != x, x.to(DTYPE), res)
    return out
