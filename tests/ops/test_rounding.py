"""Seeded stochastic rounding: bit recipe, determinism, unbiasedness, edge values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import requires_cuda
from hypothesis import given, settings
from hypothesis import strategies as st

from replayssm.ops.rounding import (
    random_bits,
    resolve_seed,
    round_states,
    seed_tensor,
    state_offsets,
    stochastic_round_ref,
)

try:
    import triton
    import triton.language as tl

    from replayssm.ops.triton.rounding import (
        load_seed_mix,
        max_finite,
        stochastic_round,
        stochastic_round_pairs,
        tl_dtype,
    )
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _round_kernel(
        x_ptr, off_ptr, out_ptr, n, seed_ptr, DTYPE: tl.constexpr, MAXV: tl.constexpr, BLOCK: tl.constexpr
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        mix = load_seed_mix(seed_ptr, DTYPE)
        x = tl.load(x_ptr + i, mask=m)
        off = tl.load(off_ptr + i, mask=m)
        tl.store(out_ptr + i, stochastic_round(x, off, mix, DTYPE, MAXV), mask=m)

    @triton.jit
    def _round_pairs_kernel(
        x_ptr, out_ptr, base, seed_ptr, DTYPE: tl.constexpr, MAXV: tl.constexpr, R: tl.constexpr,
        C: tl.constexpr,
    ):
        # One (R, C) tile of a pool at offset `base`, laid out like a state tile p * N + n.
        tile = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
        x = tl.load(x_ptr + tile)
        mix = load_seed_mix(seed_ptr, DTYPE)
        tl.store(out_ptr + tile, stochastic_round_pairs(x, base + tile, mix, DTYPE, MAXV, C))


LOW = [torch.float16, torch.bfloat16]


def _random_bits_python(seed: int, offset: int) -> int:
    """The recipe of `replayssm/ops/rounding.py` on Python ints, one element at a time."""
    m = 0xFFFFFFFF
    v = (seed * 0x9E3779B9 + offset // 2) & m
    v ^= v >> 16
    v = (v * 0x7FEB352D) & m
    v ^= v >> 15
    v = (v * 0x846CA68B) & m
    v ^= v >> 16
    return v >> 16 if offset % 2 == 0 else v & 0xFFFF


def _ulp_above(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` values just above |x| (x positive, normal range)."""
    d = x.to(dtype)
    return (d.view(torch.int16) + 1).view(dtype).float() - d.float()


def _bracket(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(floor, ceil) of x in dtype, computed independently with nextafter in float64."""
    near = x.to(dtype).double()
    xd = x.double()
    down = torch.nextafter(near.to(dtype), torch.tensor(-1e9, dtype=dtype)).double()
    up = torch.nextafter(near.to(dtype), torch.tensor(1e9, dtype=dtype)).double()
    lo = torch.where(near > xd, down, near)
    hi = torch.where(near < xd, up, near)
    return lo, hi


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 + 7, -3])
def test_random_bits_follow_recipe(seed):
    """The random bits equal the lowbias32 recipe (`replayssm/ops/rounding.py`) computed on Python ints."""
    offsets = torch.tensor([0, 1, 2, 77, 2**31 - 1, 2**32 + 5, 2**33 + 1, 3 * 2**40 + 11], dtype=torch.int64)
    got = random_bits(seed, offsets).tolist()
    want = [_random_bits_python(seed, o) for o in offsets.tolist()]
    assert got == want


@pytest.mark.parametrize("seed", [0, 12345, 2**31 + 7, -3, 2**40 + 9])
def test_device_seed_equals_int_seed(seed):
    """A seed held in a one-element int64 tensor draws the bits of the same value given as an int."""
    offsets = torch.randint(0, 2**40, (257,))
    assert torch.equal(random_bits(seed_tensor(seed), offsets), random_bits(seed, offsets))
    x = torch.randn(257) * 5
    for dtype in LOW:
        a = stochastic_round_ref(x, dtype, seed_tensor(seed), offsets).view(torch.int16)
        assert torch.equal(a, stochastic_round_ref(x, dtype, seed, offsets).view(torch.int16))


@pytest.mark.parametrize(
    "bad", [3, torch.tensor([3], dtype=torch.int32), torch.tensor([1, 2]), torch.tensor(3.0)]
)
def test_op_seed_must_be_one_int64_tensor(bad):
    """The ops take the seed as a one-element int64 tensor (read on the device); anything else raises."""
    with pytest.raises(ValueError, match="rand_seed"):
        resolve_seed(bad, torch.device("cpu"))


@pytest.mark.parametrize("dtype", LOW)
def test_same_seed_same_bits_different_seed_differs(dtype):
    """Equal (seed, offsets) give identical bits; another seed changes some roundings."""
    x = torch.randn(4096) * 3
    off = torch.randperm(100000)[:4096].to(torch.int64)
    a = stochastic_round_ref(x, dtype, 7, off)
    b = stochastic_round_ref(x.clone(), dtype, 7, off.clone())
    c = stochastic_round_ref(x, dtype, 8, off)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert (a.view(torch.int16) != c.view(torch.int16)).sum() > 100


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("frac", [0.1, 0.3, 0.5, 0.85])
def test_unbiased_in_mean(dtype, frac):
    """The mean of many roundings of x equals x (round-to-nearest would be off by min(frac, 1-frac) ulp)."""
    n = 100_000
    base = torch.tensor([1.375, -0.0625, 300.0])
    ulp = _ulp_above(base.abs(), dtype)
    x = base + torch.sign(base) * frac * ulp
    tol = 0.01  # in ulps; the sampling std is below 0.0016 ulp for n = 100k
    for i in range(3):
        xs = x[i].expand(n).contiguous()
        mean = stochastic_round_ref(xs, dtype, 3, torch.arange(n) + 1000 * i).double().mean()
        err = ((mean - x[i].double()) / ulp[i]).abs().item()
        assert err < tol, (i, err)
        rtn_err = ((xs.to(dtype).double().mean() - x[i].double()) / ulp[i]).abs().item()
        assert rtn_err > tol  # the test would catch round-to-nearest


@pytest.mark.parametrize("dtype", LOW)
def test_result_is_one_of_the_two_neighbours(dtype):
    """Each result is the dtype value just below or just above x, with the sign of x."""
    x = torch.cat([torch.randn(3000) * 10, torch.randn(1000) * 1e-6, torch.randn(1000) * 1e3])
    out = stochastic_round_ref(x, dtype, 11, torch.arange(x.numel())).double()
    lo, hi = _bracket(x, dtype)
    assert bool(((out == lo) | (out == hi)).all())
    assert bool((torch.signbit(out) == torch.signbit(x)).all())


@settings(deadline=None, max_examples=25)
@given(
    vals=st.lists(st.floats(-6e4, 6e4, width=32, allow_subnormal=False), min_size=1, max_size=64),
    seed=st.integers(0, 2**32 - 1),
)
def test_exact_values_pass_through(vals, seed):
    """Values already representable in the dtype come back unchanged, bit for bit."""
    for dtype in LOW:
        exact = torch.tensor(vals, dtype=torch.float32).to(dtype)
        out = stochastic_round_ref(exact.float(), dtype, seed, torch.arange(len(vals)))
        assert torch.equal(out.view(torch.int16), exact.view(torch.int16))


@pytest.mark.parametrize("dtype", LOW)
def test_saturation_nan_and_signed_zero(dtype):
    """|x| above max (inf included) saturates to ±max, NaN stays NaN, tiny values keep their sign."""
    big = torch.finfo(dtype).max
    tiny = torch.tensor(1, dtype=torch.int16).view(dtype).float().item()  # smallest subnormal
    x = torch.tensor([big * 1.001, -big * 1.5, float("inf"), -float("inf"), float("nan"), big, -tiny, tiny])
    x[6:] *= 0.3
    if dtype == torch.float16:
        x[0], x[1] = 65519.0, -70000.0  # above fp16 max but below fp32's
    out = stochastic_round_ref(x, dtype, 0, torch.arange(x.numel()))
    assert out[:4].float().tolist() == [big, -big, big, -big]
    assert bool(torch.isnan(out[4]))
    assert out[5].float().item() == big
    assert torch.signbit(out[6]) and not torch.signbit(out[7])
    assert out[6].float().item() in (0.0, -tiny) and out[7].float().item() in (0.0, tiny)


def test_subnormal_rounding_unbiased():
    """Below the smallest fp16 normal the rounding is still unbiased (subnormal spacing)."""
    n = 100_000
    step = 2.0**-24  # fp16 subnormal spacing
    x = torch.full((n,), 5.25 * step)
    mean = stochastic_round_ref(x, torch.float16, 9, torch.arange(n)).double().mean().item()
    assert abs(mean / step - 5.25) < 0.01


@pytest.mark.parametrize("dtype", LOW)
def test_round_up_frequency_matches_p(dtype):
    """Over many offsets, each value rounds up with probability p = (|x| - lo) / (hi - lo), the even and
    odd elements of a shared hash alike, and their two decisions are uncorrelated."""
    torch.manual_seed(5)
    n, k = 40_000, 6
    vals = torch.cat([torch.rand(k - 1) * 50 + 0.5, torch.tensor([3.3 * 2.0**-24])])  # one fp16-subnormal
    for v in vals.tolist():
        x = torch.full((n,), v)
        up = stochastic_round_ref(x, dtype, 17, torch.arange(n) + 2 * 10**9).double() > v
        lo, hi = _bracket(x[:1], dtype)
        p = ((v - lo) / (hi - lo)).item()
        sd = (p * (1 - p) / (n / 2)) ** 0.5
        for part in (up[0::2], up[1::2]):
            assert abs(part.double().mean().item() - p) < 5 * sd + 1e-4, (v, p)
        a, b = up[0::2].double(), up[1::2].double()
        cov = ((a - a.mean()) * (b - b.mean())).mean().item()
        assert abs(cov) < 5 * p * (1 - p) / (n / 2) ** 0.5 + 1e-4, (v, cov)


def test_float32_is_plain_copy():
    """dtype=float32 returns the input values untouched in a new tensor."""
    x = torch.randn(100)
    out = stochastic_round_ref(x, torch.float32, 1, torch.arange(100))
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_state_offsets_are_pool_linear_indices():
    """state_offsets(slots) equals the flat index of pool[slots] in a contiguous (S,H,P,N) pool."""
    S, H, P, N = 7, 3, 4, 5
    pool_index = torch.arange(S * H * P * N).view(S, H, P, N)
    slots = torch.tensor([5, 0, 3], dtype=torch.int32)
    assert torch.equal(state_offsets(slots, H, P, N), pool_index[slots.long()])


def test_round_states_uses_destination_offsets():
    """Rounding a state for slot s equals rounding it with that slot's pool offsets."""
    vals = torch.randn(2, 3, 4, 5)
    slots = torch.tensor([6, 2], dtype=torch.int32)
    got = round_states(vals, slots, torch.bfloat16, 5)
    want = stochastic_round_ref(vals, torch.bfloat16, 5, state_offsets(slots, 3, 4, 5))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(x=torch.randn(4).half()), "x"),
        (dict(dtype=torch.int8), "dtype"),
        (dict(offsets=torch.arange(5)), "offsets"),
        (dict(offsets=torch.arange(4, dtype=torch.int32)), "offsets"),
    ],
)
def test_bad_arguments_raise(kwargs, name):
    """Wrong dtype or shape raises ValueError naming the argument."""
    args = dict(x=torch.randn(4), dtype=torch.float16, seed=0, offsets=torch.arange(4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        stochastic_round_ref(**args)


def check_triton_twin(device: str) -> None:
    """Triton's stochastic_round and stochastic_round_pairs give the reference's bits on normal, tiny
    (fp32-subnormal included), huge and special values."""
    torch.manual_seed(0)
    specials = [float("inf"), -float("inf"), float("nan"), 7e4, -7e4, 65519.0, 3.4e38, -3.39e38, -0.0, 0.0,
                1e-40, -3e-39, 2.0**-14, -(2.0**-14) * 0.999]
    x = torch.cat(
        [torch.randn(2000) * 10, torch.randn(500) * 1e-6, torch.randn(500) * 1e4, torch.randn(34) * 1e-38,
         torch.randn(1048) * 1e-2,
         torch.tensor(specials)]
    )
    off = torch.randint(0, 2**40, x.shape)
    R, C = 16, 256  # x.numel() = R * C
    base = 2 * 2**33 + 1000
    for dtype in LOW:
        t = tl_dtype(dtype)
        seed = seed_tensor(123, device)
        out = torch.empty(x.shape, dtype=dtype, device=device)
        grid = (triton.cdiv(x.numel(), 256),)
        _round_kernel[grid](x.to(device), off.to(device), out, x.numel(), seed, t, max_finite(t), BLOCK=256)
        ref = stochastic_round_ref(x, dtype, 123, off)
        same = out.cpu().view(torch.int16) == ref.view(torch.int16)
        assert bool(same.all()), (dtype, x[~same][:5], out.cpu()[~same][:5], ref[~same][:5])

        pairs = torch.empty(x.shape, dtype=dtype, device=device)
        _round_pairs_kernel[(1,)](x.to(device), pairs, base, seed, t, max_finite(t), R=R, C=C)
        ref = stochastic_round_ref(x, dtype, 123, base + torch.arange(x.numel()))
        same = pairs.cpu().view(torch.int16) == ref.view(torch.int16)
        assert bool(same.all()), (dtype, x[~same][:5], pairs.cpu()[~same][:5], ref[~same][:5])


@pytest.mark.skipif(triton is None, reason="needs triton")
def test_triton_twin_bit_exact_interpreted():
    """Under the Triton CPU interpreter the device functions reproduce the reference bits."""
    here = Path(__file__).resolve().parent
    path = os.pathsep.join(
        [str(here.parent.parent), str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    code = "import test_rounding; test_rounding.check_triton_twin('cpu')"
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-4000:]


@requires_cuda
@pytest.mark.skipif(triton is None, reason="needs triton")
def test_triton_twin_bit_exact_cuda():
    """On the GPU the Triton device functions reproduce the reference bits."""
    check_triton_twin("cuda")
