"""Triton chunked SSD scan and boundary states vs the reference and the float64 oracle."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from interpret import run_interpreted

pytest.importorskip("triton")

# The Nemotron-H-8B Mamba head shape.
SHAPE_8B = dict(H=128, G=8, P=64, N=128, chunk=128)


def test_ssd_interpreted():
    """Under the interpreter: outputs, final states (fp32/fp16/bf16 pools) and boundary states match
    the reference and the oracle; padding outputs zero; untouched slots and reruns bit-exact."""
    run_interpreted("ssd")


@requires_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_ssd_gpu_8b_shape(state_dtype):
    """8B head shape, chunk 128: a 1,040-token sequence with a boundary every 16 tokens plus short,
    empty and padding sequences match the reference and the oracle."""
    from ssd_cases import check_ssd_scan

    check_ssd_scan("cuda", lengths=[1040, 7, 0, 130, 64, 3], act=torch.bfloat16, state_dtype=state_dtype,
                   every=16, oracle_seqs=[0, 1, 3], **SHAPE_8B)


@requires_cuda
@pytest.mark.parametrize("full", [False, True])
def test_ssd_gpu_fp32_odd_shape(full):
    """fp32 activations, odd head/state sizes, chunk 64: both the Triton scan and the reference scan
    with Triton boundaries match the reference and the oracle."""
    from ssd_cases import check_ssd_scan

    check_ssd_scan("cuda", lengths=[200, 63, 64, 1, 0, 129], H=12, G=3, P=48, N=40, chunk=64, full=full,
                   every=7, seed=4)


@requires_cuda
def test_ssd_gpu_small_shapes():
    """The interpreter's small cases compiled on the GPU (other tiles and layouts than the interpreter
    runs), the tiny test checkpoints' bf16 Mamba shape first."""
    from ssd_cases import run_small

    run_small("cuda")
