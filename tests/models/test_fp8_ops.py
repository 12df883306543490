"""FP8 ops (ops/fp8.py) against float64 references of the dequantized math."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA, requires_cuda

from replayssm.models.layers.mlp import Experts
from replayssm.ops.fp8 import (
    FP8_DTYPE,
    dequantize_fp8,
    fp8_linear,
    fp8_path,
    quantize_fp8,
    quantize_per_token,
    quantize_static,
    scale_rows,
)


def _rounding_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 rounding: half an ulp of 3 mantissa bits (2^-4 relative), 2^-10 * scale among subnormals."""
    return torch.maximum(w.double().abs() * 2.0 ** -4, scale.double() * 2.0 ** -10) * (1 + 1e-6)


@pytest.mark.parametrize("per_channel", [True, False])
def test_quantize_round_trip_within_e4m3_rounding(per_channel):
    """q * scale is w up to one E4M3 rounding, and each row's (or the matrix's) largest |w| maps to 448."""
    w = torch.randn(24, 40) * torch.rand(24, 1) * 3
    q, scale = quantize_fp8(w, per_channel=per_channel)
    assert q.dtype == FP8_DTYPE and scale.shape == ((24, 1) if per_channel else (1,))
    s = scale if per_channel else scale.reshape(1, 1)
    err = (q.double() * s.double() - w.double()).abs()
    assert (err <= _rounding_bound(w, s)).all()
    top = q.float().abs().amax(dim=1) if per_channel else q.float().abs().amax()
    assert torch.all(top == 448.0)


def test_stacked_per_tensor_scales_one_per_expert():
    """Stacked (E, N, K) weights get one scale per expert (E, 1, 1), and dequantize back per expert."""
    w = torch.randn(3, 8, 16) * torch.tensor([0.1, 1.0, 10.0]).view(3, 1, 1)
    q, scale = quantize_fp8(w, per_channel=False)
    assert scale.shape == (3, 1, 1)
    expected = w.double().abs().amax(dim=(1, 2)) / 448
    torch.testing.assert_close(scale.double().flatten(), expected, rtol=1e-6, atol=0)
    err = (dequantize_fp8(q, scale, torch.float64) - w.double()).abs()
    assert (err <= _rounding_bound(w, scale)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("activation", ["dynamic", "static", "none"])
def test_fp8_linear_cpu_is_dequantized_matmul(dtype, per_channel, activation):
    """On the CPU fp8_linear is x @ (q * scale).T + b, the float64 product of the dequantized weight."""
    q, scale = quantize_fp8(torch.randn(48, 32) / 6, per_channel=per_channel)
    x = torch.randn(5, 7, 32).to(dtype)
    bias = torch.randn(48).to(dtype)
    input_scale = torch.tensor([0.02]) if activation == "static" else None
    out = fp8_linear(x, q, scale, bias, input_scale, activation)
    s = scale.double() if per_channel else scale.double().reshape(1, 1)
    w64 = (q.double() * s).to(dtype).double()  # the weight the reference runs: rounded once to x.dtype
    ref = x.double() @ w64.T + bias.double()
    assert out.shape == (5, 7, 48) and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref, **tol)


def test_per_token_quantization():
    """Each token's scale is its amax / 448 and its E4M3 values times that scale are x up to one rounding."""
    x = torch.randn(9, 64) * torch.rand(9, 1) * 5
    xq, scale = quantize_per_token(x)
    expected = x.double().abs().amax(1, keepdim=True) / 448
    torch.testing.assert_close(scale.double(), expected, rtol=1e-6, atol=0)
    err = (xq.double() * scale.double() - x.double()).abs()
    assert (err <= _rounding_bound(x, scale)).all()


def test_static_quantization_gives_every_row_the_input_scale():
    """quantize_static divides by the per-tensor input scale and returns it as every row's (M, 1) scale."""
    x = torch.randn(6, 32).to(torch.bfloat16)
    input_scale = torch.tensor([0.0123])
    xq, scale = quantize_static(x, input_scale)
    assert scale.shape == (6, 1) and torch.all(scale == input_scale)
    err = (xq.double() * scale.double() - x.double()).abs()
    assert (err <= _rounding_bound(x, scale)).all()


def test_scale_rows_per_channel_is_a_view():
    """A per-channel scale reaches the row-wise GEMM as a view of its parameter: (N, 1) -> (1, N),
    (E, N, 1) -> (E, N), no copy."""
    for shape, rows in (((24, 1), (1, 24)), ((3, 24, 1), (3, 24))):
        s = torch.rand(shape) + 0.5
        got = scale_rows(s, 24)
        assert got.shape == rows and got.is_contiguous() and got.data_ptr() == s.data_ptr()
        assert torch.equal(got.flatten(), s.flatten())


def test_scale_rows_per_tensor_expanded_once():
    """A per-tensor (1,) or per-expert (E, 1, 1) scale is expanded to dense rows once and kept; a scale
    loaded in place afterwards is expanded again."""
    for s, rows in ((torch.tensor([0.5]), (1, 16)), (torch.tensor([0.5, 2.0]).view(2, 1, 1), (2, 16))):
        s = torch.nn.Parameter(s, requires_grad=False)
        first = scale_rows(s, 16)
        assert first.shape == rows and first.is_contiguous()
        assert torch.equal(first, s.reshape(-1, 1).expand(rows))
        assert scale_rows(s, 16) is first
        s.copy_(s * 3)
        assert torch.equal(scale_rows(s, 16), s.reshape(-1, 1).expand(rows))


def test_cpu_dispatch_takes_the_reference():
    """Every activation scheme runs the dequantized reference on the CPU."""
    q, scale = quantize_fp8(torch.randn(32, 32))
    for activation in ("dynamic", "static", "none"):
        assert fp8_path(torch.randn(2, 32), q, scale, activation) == "dequant"


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_experts_equal_dequantized_expert_loop(per_channel):
    """FP8 stacked experts compute sum_k w_k * down_e(relu2(up_e x)) with the dequantized weights."""
    E, hidden, inter, T, k = 4, 16, 24, 11, 2
    experts = Experts(E, hidden, inter, "relu2")
    up, up_s = quantize_fp8(torch.randn(E, inter, hidden) / 4, per_channel=per_channel)
    down, down_s = quantize_fp8(torch.randn(E, hidden, inter) / 5, per_channel=per_channel)
    experts.up_proj = torch.nn.Parameter(up, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
    experts.up_proj_scale = torch.nn.Parameter(up_s, requires_grad=False)
    experts.down_proj_scale = torch.nn.Parameter(down_s, requires_grad=False)
    x = torch.randn(T, hidden)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k)
    out = experts(x, weights, ids)
    up64 = dequantize_fp8(up, up_s, torch.float32).double()
    down64 = dequantize_fp8(down, down_s, torch.float32).double()
    ref = torch.zeros(T, hidden, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            h = torch.relu(up64[e] @ x[t].double()) ** 2
            ref[t] += weights[t, j].double() * (down64[e] @ h)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _cap() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if HAS_CUDA else (0, 0)


@requires_cuda
@pytest.mark.skipif(_cap() < (8, 9), reason="FP8 tensor cores need compute capability >= 8.9")
@pytest.mark.parametrize("scheme", [("dynamic", True), ("dynamic", False), ("static", False),
                                    ("static", True)])
@pytest.mark.parametrize("M", [1, 5, 64])
def test_scaled_mm_matches_quantized_activation_reference(scheme, M):
    """On CUDA the _scaled_mm path equals the float64 product of the E4M3 activations and weights with
    their scales (rounded once to bf16), per-token or static activation scales, per-channel or per-tensor
    weight scales."""
    activation, per_channel = scheme
    N, K = 96, 128
    q, scale = quantize_fp8(torch.randn(N, K, device="cuda") / 10, per_channel=per_channel)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    bias = torch.randn(N, device="cuda").to(torch.bfloat16)
    input_scale = None
    if activation == "static":
        input_scale = torch.tensor([x.float().abs().max().item() / 448], device="cuda")
    path = fp8_path(x, q, scale, activation)
    if path == "dequant":
        pytest.skip(f"no FP8 GEMM for this scheme on compute capability {_cap()}")
    out = fp8_linear(x, q, scale, bias, input_scale, activation)
    if input_scale is None:
        xq, xs = quantize_per_token(x)
    else:
        xq, xs = (x.float() / input_scale).clamp(-448, 448).to(FP8_DTYPE), input_scale.reshape(1, 1)
    s = scale.double() if per_channel else scale.double().reshape(1, 1)
    ref = (xq.double() * xs.double()) @ (q.double() * s).T + bias.double()
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    torch.testing.assert_close(out.double(), ref, rtol=1.6e-2, atol=1e-2)
    # and it is the FP8 approximation of the dequantized reference (activation rounding only)
    deq = x.double() @ (q.double() * s).T + bias.double()
    assert (out.double() - deq).abs().max() < 0.1 * deq.abs().max()
