"""Triton causal conv1d update, commit and varlen prefill vs their references (interpreter; GPU if any)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

pytest.importorskip("triton")

# Nemotron-like prefill batch: one 1,100-token sequence, empty / 1-token / shorter-than-K-1 ones, and
# lengths around multiples of the 32-token block; check_conv_varlen pads index 10 (200 tokens) and 1.
GPU_LENGTHS = (1100, 0, 1, 2, 3, 700, 37, 64, 65, 5, 200, 3)


def test_conv_interpreted():
    """Interpreted: update (window unchanged), commit (exact) and varlen prefill match the references."""
    run_interpreted("conv")


@requires_cuda
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,q", [(4, 1), (4, 4), (2, 3)])
def test_conv_gpu(act, K, q):
    """On the GPU at a Nemotron-like channel count: update and commit match the reference."""
    from triton_cases import check_conv

    check_conv("cuda", Dc=1000, K=K, b=12, q=q, S=40, act=act)


@requires_cuda
@pytest.mark.parametrize("q", [1, 2])
@pytest.mark.parametrize("flat", [False, True])
def test_conv_advance_gpu_engine_size(q, flat):
    """On the GPU at the 8B decode size (D_conv 10,240, 256 rows, bf16): advance_window's windows
    equal a full commit's step after step (no thread writes a column before another read it), per
    channel and as contiguous runs."""
    from triton_cases import check_conv_advance

    check_conv_advance("cuda", q=q, flat=flat)


# (K, D_conv, bias, x a strided column slice)
VARLEN_SHAPES = [(4, 2560, True, True), (4, 1000, False, False), (2, 3000, True, False), (3, 999, True, True)]


@requires_cuda
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,Dc,bias,strided", VARLEN_SHAPES)
def test_conv_varlen_gpu(act, K, Dc, bias, strided):
    """On the GPU: varlen outputs match the reference, final windows bit-exact, other slots untouched."""
    from triton_cases import check_conv_varlen

    check_conv_varlen("cuda", Dc=Dc, K=K, lengths=GPU_LENGTHS, S=40, act=act, bias=bias, strided=strided)


@requires_cuda
def test_conv_varlen_gpu_bf16_state():
    """On the GPU: fp32 inputs with a bf16 window pool round the final windows exactly as the reference."""
    from triton_cases import check_conv_varlen

    check_conv_varlen("cuda", Dc=1000, K=4, lengths=GPU_LENGTHS, S=40, state_dtype=torch.bfloat16)


def _varlen_args(Dc: int = 2560, K: int = 4):
    lengths = torch.tensor(GPU_LENGTHS)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
    slots = torch.randperm(40)[: len(GPU_LENGTHS)].to(torch.int32)
    slots[1] = -1
    x = torch.randn(int(lengths.sum()), Dc, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(Dc, K, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(Dc, dtype=torch.bfloat16, device="cuda")
    pool = torch.randn(40, Dc, K - 1, dtype=torch.bfloat16, device="cuda")
    init = (torch.arange(len(GPU_LENGTHS)) % 3 != 1).cuda()
    return x, w, b, pool, cu, slots.cuda(), init


@requires_cuda
def test_conv_varlen_gpu_dispatch_two_launches_no_sync():
    """On CUDA the public varlen op runs the Triton twin: two kernel launches and no host sync."""
    from replayssm.ops.common import pick_impl
    from replayssm.ops.conv1d import causal_conv1d_varlen, causal_conv1d_varlen_ref
    from replayssm.ops.triton.conv1d import causal_conv1d_varlen_triton

    args = _varlen_args()
    picked = pick_impl("conv1d", "causal_conv1d_varlen", args[0], causal_conv1d_varlen_ref)
    assert picked is causal_conv1d_varlen_triton
    causal_conv1d_varlen(*args)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        causal_conv1d_varlen(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        causal_conv1d_varlen(*args)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, kernels


@requires_cuda
def test_strided_window_columns_refused():
    """On CUDA a pool whose window columns are not contiguous raises ValueError (update and commit)."""
    from replayssm.ops.conv1d import causal_conv1d_commit, causal_conv1d_update

    pool = torch.zeros(4, 8, 6, device="cuda")[:, :, ::2]
    x, w = torch.randn(2, 1, 8, device="cuda"), torch.randn(8, 4, device="cuda")
    slots = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="contiguous"):
        causal_conv1d_update(x, w, None, pool, slots, advance_window=True)
    with pytest.raises(ValueError, match="contiguous"):
        causal_conv1d_commit(pool, x, torch.ones(2, dtype=torch.int32, device="cuda"), slots)
