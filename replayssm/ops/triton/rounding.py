"""Seeded stochastic rounding as Triton device functions (twins of `ops/rounding.py`).

`stochastic_round(x, offsets, seed_mix, DTYPE, MAXV)` gives `stochastic_round_ref`'s bits for the same
fp32 value bound for the same pool element. A kernel takes the seed by pointer (a one-element int64
tensor, `ops/rounding.py: seed_tensor`) and forms `seed_mix = (seed * 0x9E3779B9) mod 2^32` once with
`load_seed_mix`; the element's linear offset in the destination pool is added per element. Reading the
seed on the device lets a captured CUDA graph draw fresh bits at every replay.

The rounding is integer work on the fp32 bit pattern (add 16 or 13 random bits below the kept ones,
shift): no division and no conversion unit (float<->int and f32->f16 conversions issue at a quarter
or less of the integer rate). One lowbias32 hash serves two elements (offsets 2k and 2k + 1).
`stochastic_round_pairs` hashes once per pair: it takes a 2D state tile whose rows run over
consecutive offsets (`base + p * N + n`), the form the state update and the replay flushes store.
`stochastic_round` takes any layout and hashes per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT_SEEDS: dict[tuple[int, torch.device], torch.Tensor] = {}


def device_seed(rand_seed: int | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The seed tensor a kernel reads: rand_seed itself when it is one (the ops pass the engine's), or
    for an int (None: 0) a tensor made once per (value, device) and kept. Benchmarks and tests call
    the launchers with ints; a launch captured in a CUDA graph after a warm-up run finds its tensor
    made (a capture cannot copy from the host)."""
    if isinstance(rand_seed, torch.Tensor):
        return rand_seed
    key = (int(rand_seed or 0), device)
    seed = _INT_SEEDS.get(key)
    if seed is None:
        seed = _INT_SEEDS[key] = torch.tensor([key[0]], dtype=torch.int64, device=device)
    return seed


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
def load_seed_mix(seed_ptr, DTYPE: tl.constexpr):
    """(seed * 0x9E3779B9) mod 2^32 (uint32) from the int64 seed at seed_ptr; 0 without a read when
    DTYPE is fp32 (nothing rounds)."""
    mix = tl.zeros((), dtype=tl.uint32)
    if DTYPE != tl.float32:
        # int64 -> uint32 keeps the low 32 bits; uint32 products wrap mod 2^32.
        mix = tl.load(seed_ptr).to(tl.uint32) * 0x9E3779B9
    return mix


@triton.jit
def _lowbias32(v):
    """The lowbias32 finalizer on uint32 (multiplies wrap mod 2^32, shifts are logical)."""
    v = v ^ (v >> 16)
    v = v * 0x7FEB352D
    v = v ^ (v >> 15)
    v = v * 0x846CA68B
    v = v ^ (v >> 16)
    return v


@triton.jit
def _round16(x, r, DTYPE: tl.constexpr, MAXV: tl.constexpr):
    """fp32 x to DTYPE (fp16/bf16) with the 16 random bits r (uint32 < 2^16), as the reference does."""
    xbits = x.to(tl.uint32, bitcast=True)
    mbits = xbits & 0x7FFFFFFF
    mag = mbits.to(tl.float32, bitcast=True)
    if DTYPE == tl.bfloat16:
        code = (mbits + r) >> 16
        top = 0x7F7F
        nan = 0x7FC0
    else:
        # Below 2^-14, |x| + 2^-14 carries fp16's subnormal spacing at the same 13 dropped bits.
        sub = mag < 6.103515625e-05
        f = tl.where(sub, mag + 6.103515625e-05, mag).to(tl.uint32, bitcast=True)
        rebias = tl.where(sub, 0x1C400, 0x1C000).to(tl.uint32)
        code = ((f + (r >> 3)) >> 13) - rebias
        top = 0x7BFF
        nan = 0x7E00
    code = tl.where(mag > MAXV, top, code)
    code = tl.where(mbits > 0x7F800000, nan, code)
    # x's sign bit onto the 16-bit pattern (keeps -0.0, like copysign).
    code = code | ((xbits >> 16) & 0x8000)
    return code.to(tl.uint16).to(DTYPE, bitcast=True)


@triton.jit
def random_bits(offsets, seed_mix):
    """The reference's 16 random bits (uint32 < 2^16) per element; offsets any non-negative integers."""
    v = _lowbias32((offsets >> 1).to(tl.uint32) + seed_mix)
    return tl.where((offsets & 1) == 0, v >> 16, v & 0xFFFF)


@triton.jit
def stochastic_round(x, offsets, seed_mix, DTYPE: tl.constexpr, MAXV: tl.constexpr):
    """Round fp32 `x` to DTYPE (fp16/bf16) stochastically; fp32 passes through unchanged.

    offsets: integer, x's shape, the element's linear index in the destination pool (any layout).
    """
    out = x
    if DTYPE != tl.float32:
        out = _round16(x, random_bits(offsets, seed_mix), DTYPE, MAXV)
    return out


@triton.jit
def stochastic_round_pairs(x, offsets, seed_mix, DTYPE: tl.constexpr, MAXV: tl.constexpr, N: tl.constexpr):
    """`stochastic_round` of a state tile with one hash per pair of elements (same bits).

    x, offsets: 2D (R, C), offsets = base + p * N + n over C consecutive columns n from an even one,
    base a multiple of N. With N and C even each pair (2k, 2k + 1) sits side by side in a row; with
    either odd this is `stochastic_round`.
    """
    out = x
    if DTYPE != tl.float32:
        R: tl.constexpr = x.shape[0]
        C: tl.constexpr = x.shape[1]
        if N % 2 == 0 and C % 2 == 0:
            x_even, x_odd = tl.split(tl.reshape(x, (R, C // 2, 2)))
            o_even, _ = tl.split(tl.reshape(offsets, (R, C // 2, 2)))
            v = _lowbias32((o_even >> 1).to(tl.uint32) + seed_mix)
            y_even = _round16(x_even, v >> 16, DTYPE, MAXV)
            y_odd = _round16(x_odd, v & 0xFFFF, DTYPE, MAXV)
            out = tl.reshape(tl.join(y_even, y_odd), (R, C))
        else:
            out = _round16(x, random_bits(offsets, seed_mix), DTYPE, MAXV)
    return out
