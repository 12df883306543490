import contextlib
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


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparisons (NaN-safe)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_close(actual, expected, tol: float, what: str = "") -> None:
    """max |actual - expected| <= tol * max(|expected|, 1), in float64 (equal-shaped empty tensors pass)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.double().abs().max().item(), 1.0)
    assert err <= tol * scale, f"{what}: max err {err:.3g} > {tol} * {scale:.3g}"


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def sync_forbidden():
    """Inside, any CUDA operation that waits on the device raises (set_sync_debug_mode("error"))."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_decode_step_has_no_host_sync(path, replayssm: bool) -> None:
    """A ModelRunner on the checkpoint at path (dummy bf16 weights) prefills three rows in permuted slots,
    then runs three decode steps; the warm ones (after the first compiles the kernels) execute and commit
    with syncs forbidden, and their logits are finite."""
    from replayssm.engine.model_runner import ModelRunner, ScheduledRow

    runner = ModelRunner(path, device="cuda", dtype="bfloat16", replayssm=replayssm, load_format="dummy",
                         num_slots=8, max_num_seqs=4, num_kv_blocks=32, kv_block_size=16)
    slots, prompts = [5, 2, 7], [[3, 9, 4, 1, 8], [7, 7, 2], [11, 5, 6, 9, 10, 12, 3]]
    tables = [[i * 4 + j for j in range(4)] for i in range(3)]
    rows = [ScheduledRow(p, 0, t, s, True) for p, t, s in zip(prompts, tables, slots)]
    runner.execute(rows)
    runner.commit(rows, [1] * 3)
    pos = [len(p) for p in prompts]
    for step in range(3):
        rows = [ScheduledRow([17 + step], n, t, s, False) for n, t, s in zip(pos, tables, slots)]
        torch.cuda.synchronize()
        with sync_forbidden() if step else contextlib.nullcontext():
            logits = runner.execute(rows)
            runner.commit(rows, [1] * 3)
        assert torch.isfinite(logits).all()
        pos = [n + 1 for n in pos]
