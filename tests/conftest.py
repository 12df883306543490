import os

import pytest
import torch

# Tiny models on a shared 2-core CI box: one thread is several times faster than two
# (oversubscription under load), and results do not depend on the thread count.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
CUDA_REASON = "needs CUDA"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=CUDA_REASON)


def pytest_collection_modifyitems(config, items):
    """Tag every CUDA-only test with the `gpu` marker, so `pytest -m gpu` runs just those."""
    for item in items:
        if any(m.name == "skipif" and m.kwargs.get("reason") == CUDA_REASON for m in item.iter_markers()):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def poisoned(*shape, dtype=torch.float32, device="cpu"):
    """An output buffer full of NaN, so an unwritten element cannot pass a check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
