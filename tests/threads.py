"""The `one_thread` fixture: import it into a test module (directly or through a helper module that
imports it) to make it autouse there."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models step fastest on one thread (and CI jobs side by side do not oversubscribe the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
