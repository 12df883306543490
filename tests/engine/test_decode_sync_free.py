"""The CUDA decode step (inputs, forward, commit) never waits on the device (no host sync)."""

import json

import pytest
import torch
from conftest import check_decode_step_has_no_host_sync, requires_cuda

# Every layer kind, dims that fit the bf16 grouped GEMM (multiples of 16).
CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "vocab_size": 256, "hidden_size": 128,
    "hybrid_override_pattern": "M*EM-", "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
    "n_groups": 2, "conv_kernel": 4, "chunk_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "intermediate_size": 192, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64, "dtype": "bfloat16",
}


@requires_cuda
@pytest.mark.parametrize("replayssm", [True, False])
def test_decode_step_has_no_host_sync(tmp_path, replayssm):
    """With torch.cuda.set_sync_debug_mode("error"), a warm decode step's execute + commit raise nothing."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    check_decode_step_has_no_host_sync(tmp_path, replayssm)


def _warm_step_syncs(tmp_path, max_tokens: int, warm_steps: int = 1, **engine_kw) -> tuple[list, list[str]]:
    """Three requests through a prefill and warm_steps warm-up steps, then one step with sync warnings
    on: (its outputs, the messages of the synchronizing operations it made)."""
    import warnings

    from replayssm.config import EngineConfig
    from replayssm.engine.llm_engine import LLMEngine
    from replayssm.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    engine_kw.setdefault("cuda_graphs", False)  # eager steps unless a test asks for graphs
    engine = LLMEngine(EngineConfig.from_kwargs(str(tmp_path), device="cuda", dtype="bfloat16",
                                                load_format="dummy", max_num_seqs=4, memory_budget=1 << 28,
                                                **engine_kw))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, n in enumerate((5, 3, 7)):
        engine.add_request(f"r{i}", [3 + (i * 5 + j) % 200 for j in range(n)], params)
    engine.step()  # prefill
    for _ in range(warm_steps):
        engine.step()  # the first decode / verify step compiles the kernels
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            outs = engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only real syncs: sync debug mode also warns that it is a prototype feature.
    return outs, [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


@requires_cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_engine_decode_step_syncs_once(tmp_path, graphs):
    """A warm greedy LLMEngine decode step syncs with the device once: reading the sampled tokens
    (eager, or replaying the graph a warm-up step captured)."""
    outs, syncs = _warm_step_syncs(tmp_path, 8, cuda_graphs=graphs, warm_steps=2 if graphs else 1)
    assert len(outs) == 3 and len(syncs) <= 1, syncs


@requires_cuda
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("replayssm", [True, False])
def test_engine_verify_step_syncs_once(tmp_path, replayssm, interleave):
    """A warm greedy speculative (synthetic, k = 3) verify step syncs once: reading the verified tokens.
    Interleaved (two request groups, the CUDA default), a step is one group's turn: it waits once,
    for that group's previous step."""
    outs, syncs = _warm_step_syncs(tmp_path, 24, replayssm=replayssm, num_speculative_tokens=3,
                                   speculative_method="synthetic", synthetic_acceptance_length=2.5,
                                   async_scheduling=interleave, warm_steps=3 if interleave else 1)
    assert len(outs) == (2 if interleave else 3) and len(syncs) <= 1, syncs


@requires_cuda
@pytest.mark.parametrize("host_threads, want", [(1, 1), (3, 3), (0, None)])
def test_engine_on_cuda_sets_host_threads(tmp_path, host_threads, want):
    """An engine on CUDA sets PyTorch's CPU threads to host_threads (0: left as it was)."""
    from replayssm.config import EngineConfig
    from replayssm.engine.llm_engine import LLMEngine

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    before = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        LLMEngine(EngineConfig.from_kwargs(str(tmp_path), device="cuda", dtype="bfloat16",
                                           load_format="dummy", max_num_seqs=2, memory_budget=1 << 26,
                                           host_threads=host_threads))
        assert torch.get_num_threads() == (want or 5)
    finally:
        torch.set_num_threads(before)
