"""Seeded stochastic rounding of fp32 states into fp16/bf16 pools (PyTorch reference).

The random bits depend only on (seed, offset), where offset is the element's linear index in
the destination pool tensor, so the Triton twin (`replayssm/ops/triton/rounding.py`) produces
the same bits for the same write, whatever the launch layout. The seed lives in device memory: the
ops take it as a one-element int64 tensor (`seed_tensor`) and read it on the device, so a captured
CUDA graph reads the value current at each replay. The recipe (seed taken mod 2^32):

    v = uint32(seed * 0x9E3779B9 + offset)          (mod 2^32)
    v ^= v >> 16; v *= 0x7FEB352D; v ^= v >> 15; v *= 0x846CA68B; v ^= v >> 16   ("lowbias32")
    r = (v >> 8) * 2^-24                             in [0, 1), exact in fp32
    d = x rounded toward zero; u = next value away from zero
    result = d if d == x else (u if r < (|x| - |d|) / (|u| - |d|) else d)

|x| above the largest finite value of the dtype (inf included) saturates to ±max; NaN stays
NaN. Every step is exact in fp32, so E[result] = x and the bits are reproducible.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_LOW_DTYPES = (torch.float16, torch.bfloat16)


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


def random_uniform(seed: int | torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The uniform r in [0, 1) (fp32, same shape as offsets) that the rounding draws per element.

    seed: an int, or a one-element int64 tensor on offsets' device (read there).
    """
    v = (_seed_mix(seed, offsets.device) + offsets.to(torch.int64)) & _MASK32
    v = v ^ (v >> 16)
    v = _mul32(v, _M1)
    v = v ^ (v >> 15)
    v = _mul32(v, _M2)
    v = v ^ (v >> 16)
    # 24 random bits scaled by 2^-24: exact in fp32, never reaches 1.
    return (v >> 8).to(torch.float32) * (2.0**-24)


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
    mag = x.abs()
    # Round to nearest, then step one code toward zero if that overshot: truncation toward zero.
    # The magnitudes are non-negative, so integer steps on the bit pattern move by one ulp.
    near = mag.to(dtype)
    bits = near.view(torch.int16)
    bits = torch.where(near.float() > mag, bits - 1, bits)
    d = bits.view(dtype).float()
    u = (bits + 1).view(dtype).float()
    # |x| - |d| and |u| - |d| are exact (Sterbenz; u - d is a power of two), so p is exact.
    p = (mag - d) / (u - d)
    r = random_uniform(seed, offsets)
    out = torch.where((mag != d) & (r < p), u, d)
    out = torch.where(mag > torch.finfo(dtype).max, torch.finfo(dtype).max, out)
    out = torch.copysign(out, x)
    out = torch.where(torch.isnan(x), x, out)
    return out.to(dtype)


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
