import os

import pytest
import torch

# Tiny models on a shared 2-core CI box: one thread is several times faster than two
# (oversubscription under load), and results do not depend on the thread count.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
CUDA_REASON = "needs CUDA"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=CUDA_REASON)
# A small Nemotron-H (Mamba, attention, MLP) for engine tests on the GPU with dummy weights.
TINY_HYBRID_BF16 = {
    "architectures": ["NemotronHForCausalLM"], "vocab_size": 256, "hidden_size": 128,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
    "chunk_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 192, "hybrid_override_pattern": "M*M-M-", "dtype": "bfloat16",
}


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
