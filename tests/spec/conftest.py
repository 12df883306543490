import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (no oversubscription when CI runs jobs side by side)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
