"""ReplaySSM speculative decoding admits more requests than the 1 + k-slot baseline under one budget."""

import pytest
from spec_helpers import generate, make_llm, one_thread, target  # noqa: F401 (autouse fixture)

from replayssm import SamplingParams
from replayssm.cache.planner import plan_cache, slots_per_request
from replayssm.engine.model_runner import ModelRunner
from replayssm.models.config import ModelConfig

# Nemotron-H-8B-like Mamba shapes (state 128, head dim 64): the ring is small next to the state.
REALISTIC = {
    "architectures": ["NemotronHForCausalLM"],
    "hybrid_override_pattern": "M-M-M*-" * 8,
    "hidden_size": 4096,
    "vocab_size": 131072,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 21504,
    "max_position_embeddings": 8192,
}


def _fit(cfg, replayssm, k, budget, **kw):
    sizes = dict(
        dtype="bfloat16",
        state_dtype="float32",
        replayssm=replayssm,
        replay_window=16,
        num_speculative_tokens=k,
        kv_block_size=16,
    )
    return plan_cache(
        budget,
        bytes_per_slot=ModelRunner.slot_bytes(cfg, **sizes),
        bytes_per_kv_block=ModelRunner.kv_block_bytes(cfg, **sizes),
        kv_block_size=16,
        max_model_len=4096,
        slots_per_request=slots_per_request(replayssm, k),
        max_num_seqs=4096,
        **kw,
    )


@pytest.mark.parametrize("k", range(1, 9))
def test_pool_arithmetic_favours_replayssm(k):
    """Realistic shapes, 64 GiB: ReplaySSM (1 slot + ring) fits more requests than 1 + k full states."""
    cfg = ModelConfig.from_hf(REALISTIC)
    replay, base = _fit(cfg, True, k, 64 << 30), _fit(cfg, False, k, 64 << 30)
    assert (replay.slots_per_request, base.slots_per_request) == (1, 1 + k)
    assert replay.num_requests_fit > base.num_requests_fit
    # The gain approaches (1 + k) x as the ring gets small next to the state.
    ratio = (1 + k) * base.bytes_per_slot / replay.bytes_per_slot
    assert replay.num_requests_fit >= int(base.num_requests_fit * ratio * 0.95)


def test_engine_runs_more_spec_requests_at_once_with_replayssm():
    """Tiny model, k = 3, one budget: ReplaySSM runs more requests concurrently, same greedy tokens."""
    k = 3
    kw = dict(num_speculative_tokens=k, speculative_method="ngram", max_num_seqs=16, replay_window=8)
    cfg = ModelConfig.from_hf(target())
    slot = ModelRunner.slot_bytes(
        cfg,
        dtype="float32",
        state_dtype="float32",
        replayssm=False,
        replay_window=8,
        num_speculative_tokens=k,
    )
    kv = ModelRunner.kv_block_bytes(cfg, dtype="float32", kv_block_size=16)
    budget = 2 * 96 // 16 * kv + 2 * (1 + k) * slot + slot // 2  # the baseline fits exactly 2 requests
    replay, base = make_llm(memory_budget=budget, **kw), make_llm(memory_budget=budget, replayssm=False, **kw)
    assert base.get_metrics()["num_requests_fit"] == 2 < replay.get_metrics()["num_requests_fit"]
    ps = [[3 + i, 40 + i, 7, 9 + 2 * i, 11] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert generate(replay, params, ps) == generate(base, params, ps)
    r, b = replay.get_metrics(), base.get_metrics()
    assert r["peak_running_requests"] > b["peak_running_requests"] == 2
    assert r["spec_verify_steps"] > 0 and b["spec_verify_steps"] > 0
