import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def poisoned(*shape, dtype=torch.float32, device="cpu"):
    """An output buffer full of NaN, so an unwritten element cannot pass a check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
