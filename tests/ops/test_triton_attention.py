"""Triton paged attention (decode/verify and prefill kernels) vs the PyTorch paged attention (interpreter,
GPU when present)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

pytest.importorskip("triton")


def test_paged_decode_attention_interpreted():
    """Under TRITON_INTERPRET=1 (fresh process): decode/verify rows (with and without key splits) and
    prefill chunks, GQA, permuted blocks match the ref. Skips where the interpreter cannot run them
    (`interpret.interpreter_problem`)."""
    run_interpreted(script="attention_cases.py")


def test_decode_splits_by_rows_and_context():
    """Key splits: none where rows x KV heads give every SM two programs, a power of two up to 32 for a
    few rows, never a run shorter than 256 keys of the longest row."""
    from replayssm.ops.triton.attention import decode_splits

    assert decode_splits(256 * 8, 1032, 132) == 1  # mode (a): 2,048 programs
    assert decode_splits(132, 100_000, 132) == 2
    assert decode_splits(8, 13_000, 132) == 32  # one row, 8 KV heads: 33 wanted, capped
    assert decode_splits(8, 3_000, 132) == 8  # 11 runs of 256 keys at most
    assert decode_splits(8, 300, 132) == 1
    assert decode_splits(64, 65_536, 132) == 4  # 5 wanted


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("splits", [None, 1, 32])
def test_paged_decode_attention_gpu(dtype, q_len, splits):
    """On the GPU at Nemotron-H-8B attention shapes (32 heads, 8 KV heads, dim 128): matches the ref,
    with the kernel's split choice (4 here), one run per row and 32 runs (most empty on short rows)."""
    from attention_cases import check_decode

    check_decode("cuda", dtype, heads=32, kv_heads=8, D=128, block_size=16, q_lens=(q_len,) * 6,
                 ctx_lens=(q_len, 17, 100, 333, 1024, 2049), splits=splits)


@requires_cuda
@pytest.mark.parametrize("q_len", [1, 4])
def test_paged_decode_attention_one_long_row_gpu(q_len):
    """One row over 13,000 keys (mode (c)'s decode), split 32 ways by default: matches the ref."""
    from attention_cases import check_decode

    check_decode("cuda", torch.bfloat16, heads=32, kv_heads=8, D=128, block_size=16, q_lens=(q_len,),
                 ctx_lens=(13_000,))


@requires_cuda
def test_paged_attention_dispatch_uses_triton_for_decode():
    """paged_attention on CUDA with short rows equals the Triton kernel's output exactly (it dispatched)."""
    from attention_cases import make_case

    from replayssm.ops.attention import paged_attention
    from replayssm.ops.triton.attention import paged_attention_triton

    gen = torch.Generator().manual_seed(3)
    case = make_case("cuda", torch.bfloat16, [1, 2, 1], [7, 40, 3], 8, 2, 64, 16, gen)
    kw = dict(scale=0.125, max_query_len=2, max_context_len=40)
    assert torch.equal(paged_attention(*case, **kw), paged_attention_triton(*case, **kw))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_attention_gpu(dtype):
    """On the GPU at Nemotron-H-8B attention shapes: whole prompts, chunks after cached context that
    cross tile edges, and decode rows in one batch match the float64 reference."""
    from attention_cases import check_prefill

    check_prefill("cuda", dtype, heads=32, kv_heads=8, D=128, block_size=16, q_lens=(1040, 1, 300, 129, 4),
                  ctx_lens=(3121, 700, 300, 1153, 4))


@requires_cuda
def test_paged_attention_dispatch_uses_triton_for_prefill():
    """paged_attention on CUDA with a long row equals the Triton prefill kernel's output exactly."""
    from attention_cases import make_case

    from replayssm.ops.attention import paged_attention
    from replayssm.ops.triton.attention import paged_prefill_attention_triton

    gen = torch.Generator().manual_seed(4)
    case = make_case("cuda", torch.bfloat16, [40, 1], [90, 3], 8, 2, 64, 16, gen)
    kw = dict(scale=0.125, max_query_len=40, max_context_len=90)
    assert torch.equal(paged_attention(*case, **kw), paged_prefill_attention_triton(*case, **kw))


@requires_cuda
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_paged_decode_attention_fp8_cache_gpu(q_len, splits):
    """Decode/verify over an E4M3 cache with scales (bf16 queries, Nemotron-H-8B shapes) matches the
    float64 reference over the dequantized K/V."""
    from attention_cases import check_decode

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("E4M3 loads need compute capability 8.9")
    check_decode("cuda", torch.bfloat16, heads=32, kv_heads=8, D=128, block_size=16, q_lens=(q_len,) * 6,
                 ctx_lens=(q_len, 17, 100, 333, 1024, 2049), splits=splits, kv_scales=(0.02, 0.007))


@requires_cuda
def test_paged_prefill_attention_fp8_cache_gpu():
    """Prefill chunks, cached context and decode rows over an E4M3 cache with scales match the float64
    reference over the dequantized K/V."""
    from attention_cases import check_prefill

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("E4M3 loads need compute capability 8.9")
    check_prefill("cuda", torch.bfloat16, heads=32, kv_heads=8, D=128, block_size=16,
                  q_lens=(1040, 1, 300, 129, 4), ctx_lens=(3121, 700, 300, 1153, 4), kv_scales=(0.02, 0.007))
