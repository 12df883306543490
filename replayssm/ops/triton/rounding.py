"""Seeded stochastic rounding as a Triton device function (twin of `ops/rounding.py`).

`stochastic_round(x, offsets, seed_mix, DTYPE)` gives `stochastic_round_ref`'s bits for the same fp32
value bound for the same pool element. A kernel takes the seed by pointer (a one-element int64 tensor,
`ops/rounding.py: seed_tensor`) and forms `seed_mix = (seed * 0x9E3779B9) mod 2^32` once with
`load_seed_mix`; the element's linear offset in the destination pool is added per element. Reading the
seed on the device lets a captured CUDA graph draw fresh bits at every replay.

The reference's rule "round up iff r < p", p = (|x| - d) / (u - d), is evaluated without a division
(the baseline state update rounds every element it writes, so the rounding must cost little beside
the state's bytes):

    bf16: d is |x|'s top 16 bits and p = (low 16 bits) / 2^16, so with r = (v >> 8) * 2^-24
          r < p  <=>  (v >> 16) < (low 16 bits)                   (integers only)
    fp16: d = |x| converted toward zero; u - d is a power of two, so r * (u - d) and |x| - d are
          exact in fp32 and  r < p  <=>  r * (u - d) < |x| - d
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
def random_bits(offsets, seed_mix):
    """lowbias32 of (seed_mix + offset) mod 2^32 (uint32); offsets any integer type."""
    # uint32 arithmetic wraps mod 2^32 and shifts logically, exactly as the recipe needs.
    v = offsets.to(tl.uint32) + seed_mix
    v = v ^ (v >> 16)
    v = v * 0x7FEB352D
    v = v ^ (v >> 15)
    v = v * 0x846CA68B
    v = v ^ (v >> 16)
    return v


@triton.jit
def random_uniform(offsets, seed_mix):
    """r in [0, 1) (fp32): the top 24 random bits scaled by 2^-24."""
    return (random_bits(offsets, seed_mix) >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def stochastic_round(x, offsets, seed_mix, DTYPE: tl.constexpr, MAXV: tl.constexpr):
    """Round fp32 `x` to DTYPE (fp16/bf16) stochastically; fp32 passes through unchanged.

    offsets: integer, x's shape, the element's linear index in the destination pool.
    """
    out = x
    if DTYPE != tl.float32:
        v = random_bits(offsets, seed_mix)
        xbits = x.to(tl.uint32, bitcast=True)
        mbits = xbits & 0x7FFFFFFF
        mag = mbits.to(tl.float32, bitcast=True)
        # obits: the 16-bit pattern of |result|; +1 on a pattern of a non-negative value is one ulp up.
        if DTYPE == tl.bfloat16:
            obits = (mbits >> 16) + ((v >> 16) < (mbits & 0xFFFF)).to(tl.uint32)
            top = 0x7F7F
        else:
            d16 = mag.to(tl.float16, fp_downcast_rounding="rtz")
            dbits = d16.to(tl.uint16, bitcast=True).to(tl.uint32)
            d = d16.to(tl.float32)
            u = (dbits + 1).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            r = (v >> 8).to(tl.float32) * (1.0 / 16777216.0)
            obits = dbits + (r * (u - d) < mag - d).to(tl.uint32)
            top = 0x7BFF
        obits = tl.where(mag > MAXV, top, obits)
        # x's sign bit onto the 16-bit pattern (keeps -0.0, like copysign).
        obits = obits | ((xbits >> 16) & 0x8000)
        res = obits.to(tl.uint16).to(DTYPE, bitcast=True)
        out = tl.where(x != x, x.to(DTYPE), res)
    return out
