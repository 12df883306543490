"""Seeded stochastic rounding of fp32 states into fp16/bf16 pools (PyTorch reference).

The random bits depend only on (seed, offset), where offset is the element's linear index in
the destination pool tensor, so the Triton twin (`replayssm/ops/triton/rounding.py`) produces
the same bits for the same write, whatever the launch layout. The seed lives in device memory: the
ops take it as a one-element int64 tensor (`seed_tensor`) and read it on the device, so a captured
CUDA graph reads the value current at each replay. The recipe (seed taken mod 2^32):

    v = uint32(seed * 0x9E3779B9 + (offset >> 1))   (mod 2^32: one hash per pair of elements)
    v ^= v >> 16; v *= 0x7FEB352D; v ^= v >> 15; v *= 0x846CA68B; v ^= v >> 16   ("lowbias32")
    r = v >> 16 for an even offset, v & 0xFFFF for an odd one        (16 random bits)
    m = the bit pattern of |x| (fp32)
    bf16: code = (m + r) >> 16
    fp16: code = (m + (r >> 3)) >> 13, re-biased to fp16's exponent    (|x| >= 2^-14)
          code = (bits(|x| + 2^-14) + (r >> 3)) >> 13, less the code of 2^-14  (|x| < 2^-14)
    result = code with x's sign

Adding r to the bits the dtype drops and truncating rounds up with probability (dropped bits) /
2^(number dropped), and every dtype value of |x| >= 2^-14 (fp16) or any finite |x| (bf16) drops
exactly 13 or 16 bits, so E[result] = x exactly there. Below fp16's smallest normal, |x| + 2^-14
puts the subnormal spacing 2^-24 at the same 13 dropped bits; that add rounds |x| to a multiple of
2^-37 first (a bias below 2^-13 of the spacing). |x| above the largest finite value of the dtype
(inf included) saturates to ±max; NaN stays NaN. Integers only beside one fp32 add: no division and
no conversion, so the kernels that round every state they write pay a few integer operations per
element (`ops/triton/rounding.py`).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_LOW_DTYPES = (torch.float16, torch.bfloat16)
# Per dtype: (largest finite |code|, the quiet NaN code).
_TOP = {torch.float16: (0x7BFF, 0x7E00), torch.bfloat16: (0x7F7F, 0x7FC0)}
_FP16_MIN_NORMAL = 2.0**-14
_FP16_REBIAS = (127 - 15) << 10  # fp32 exponent bias minus fp16's, at the code's exponent field
_FP16_MIN_NORMAL_CODE = 0x400


def _mul32(v: torch.Tensor, m: int) -> torch.Tensor:
    """(v * m) mod 2^32 for int64 v in [0, 2^32) without int64 overflow (m < 2^32)."""
    lo = v * (m & 0xFFFF)  # < 2^48
    hi = ((v * (m >> 16)) & 0xFFFF) << 16  # only the low 16 bits survive the << 16 mod 2^32
    return (lo + hi) & _MASK32


def seed_tensor(value: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """A rounding seed the ops read on the device: int64 of shape (1,) holding `value`."""
    return torch.tensor([int(value)], dtype=torch.int64, device=device)


_ZERO_SEEDS: dict[torch.device, torch.Tensor] = {}


def resolve_seed(rand_seed: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The seed tensor an op rounds with: rand_seed, or seed 0 on `device` when None (one tensor per
    device, made once: no allocation per call). Raises ValueError unless rand_seed is a one-element
    int64 tensor on `device`."""
    if rand_seed is None:
        zero = _ZERO_SEEDS.get(device)
        if zero is None:
            zero = _ZERO_SEEDS[device] = seed_tensor(0, device)
        return zero
    if not isinstance(rand_seed, torch.Tensor) or rand_seed.dtype != torch.int64 or rand_seed.numel() != 1:
        got = f"{rand_seed.dtype} tensor of shape {tuple(rand_seed.shape)}" if isinstance(
            rand_seed, torch.Tensor) else type(rand_seed).__name__
        raise ValueError(f"rand_seed must be a one-element int64 tensor (the seed is read on the device, "
                         f"see ops/rounding.py: seed_tensor), got {got}")
    if rand_seed.device != device:
        raise ValueError(f"rand_seed is on {rand_seed.device}, the state on {device}")
    return rand_seed


def _seed_mix(seed: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """(seed * 0x9E3779B9) mod 2^32 as an int64 tensor on `device`, computed there (no host read)."""
    s = torch.as_tensor(seed, dtype=torch.int64, device=device).reshape(())
    return _mul32(s & _MASK32, _GOLDEN)


def random_bits(seed: int | torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The 16 random bits (int64 in [0, 2^16), offsets' shape) that the rounding draws per element.

    seed: an int, or a one-element int64 tensor on offsets' device (read there). The elements at
    offsets 2k and 2k + 1 share one hash: the even one takes its high half, the odd one its low half.
    """
    offsets = offsets.to(torch.int64)
    v = (_seed_mix(seed, offsets.device) + (offsets >> 1)) & _MASK32
    v = v ^ (v >> 16)
    v = _mul32(v, _M1)
    v = v ^ (v >> 15)
    v = _mul32(v, _M2)
    v = v ^ (v >> 16)
    return torch.where((offsets & 1) == 0, v >> 16, v & 0xFFFF)


def stochastic_round_ref(
    x: torch.Tensor, dtype: torch.dtype, seed: int | torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Round fp32 `x` to `dtype` (fp16/bf16) stochastically and reproducibly; fp32 is a plain copy.

    x: any shape, fp32. seed: an int or a one-element int64 tensor on x's device. offsets: int64,
    same shape as x, each element's linear index in the destination pool tensor. Returns a tensor
    of `dtype` with x's shape.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if dtype not in (torch.float32, *_LOW_DTYPES):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if offsets.shape != x.shape:
        raise ValueError(f"offsets shape {tuple(offsets.shape)} != x shape {tuple(x.shape)}")
    if offsets.dtype != torch.int64:
        raise ValueError(f"offsets must be int64, got {offsets.dtype}")
    if offsets.device != x.device:
        raise ValueError(f"offsets is on {offsets.device}, x on {x.device}")
    if dtype == torch.float32:
        return x.clone()
    xbits = x.view(torch.int32).to(torch.int64) & _MASK32
    mbits = xbits & 0x7FFFFFFF
    mag = x.abs()
    r = random_bits(seed, offsets)
    if dtype == torch.bfloat16:
        code = (mbits + r) >> 16
    else:
        # Below 2^-14, |x| + 2^-14 has fp16's subnormal spacing at the same 13 dropped bits.
        sub = mag < _FP16_MIN_NORMAL
        f = torch.where(sub, mag + _FP16_MIN_NORMAL, mag).view(torch.int32).to(torch.int64)
        code = ((f + (r >> 3)) >> 13) - _FP16_REBIAS - torch.where(sub, _FP16_MIN_NORMAL_CODE, 0)
    top, nan = _TOP[dtype]
    code = torch.where(mag > torch.finfo(dtype).max, top, code)
    code = torch.where(torch.isnan(x), nan, code)
    code = code | ((xbits >> 16) & 0x8000)
    # The 16-bit pattern as a signed int16 (codes >= 2^15 are the negative values).
    return (code - ((code >> 15) << 16)).to(torch.int16).view(dtype)


def state_offsets(slots: torch.Tensor, H: int, P: int, N: int) -> torch.Tensor:
    """Linear offsets into a (S, H, P, N) pool of the whole states of `slots`.

    slots: (b,) integer slot indices (no -1: callers drop padding rows first).
    Returns int64 (b, H, P, N) with offset ((s*H + h)*P + p)*N + n.
    """
    per_state = H * P * N
    inner = torch.arange(per_state, device=slots.device, dtype=torch.int64).view(H, P, N)
    return slots.to(torch.int64).view(-1, 1, 1, 1) * per_state + inner


def round_states(values: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype,
                 seed: int | torch.Tensor) -> torch.Tensor:
    """Round fp32 states `values` (b, H, P, N) bound for pool rows `slots` (b,) to the pool `dtype`."""
    _, H, P, N = values.shape
    return stochastic_round_ref(values.float(), dtype, seed, state_offsets(slots, H, P, N))
