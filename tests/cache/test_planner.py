import pytest

from replayssm.cache.planner import plan_cache, slots_per_request

SIZES = dict(bytes_per_slot=1000, bytes_per_kv_block=100, kv_block_size=16, max_model_len=64)


def test_plan_fits_budget_and_one_max_len_request():
    """The plan never exceeds the budget and always holds one max-length request."""
    for budget in (1400, 5000, 12345, 10**6):
        plan = plan_cache(budget, slots_per_request=1, max_num_seqs=8, **SIZES)
        assert plan.total_bytes <= budget
        assert plan.num_kv_blocks >= 4 and plan.num_slots >= 1
        assert plan.num_requests_fit == plan.num_slots <= 8
        assert plan.num_max_len_requests_fit == plan.num_kv_blocks // 4


def test_plan_arithmetic():
    """12345 bytes: reserve 4 blocks (400) -> 11 slots of 1000; the remaining 1345 bytes buy 13 blocks."""
    plan = plan_cache(12345, slots_per_request=1, max_num_seqs=64, **SIZES)
    assert (plan.num_slots, plan.num_kv_blocks, plan.num_requests_fit) == (11, 13, 11)


def test_replayssm_fits_more_requests_than_baseline_with_drafts():
    """Same budget: 1 slot per request with ReplaySSM admits more requests than 1 + k for the baseline."""
    k = 3
    assert slots_per_request(True, k) == 1 and slots_per_request(False, k) == 1 + k
    replay = plan_cache(50_000, slots_per_request=slots_per_request(True, k), max_num_seqs=256, **SIZES)
    base = plan_cache(50_000, slots_per_request=slots_per_request(False, k), max_num_seqs=256, **SIZES)
    assert replay.num_requests_fit == 49 and base.num_requests_fit == 12
    assert base.num_slots == 4 * base.num_requests_fit


def test_plan_caps_at_max_num_seqs():
    """A huge budget is capped at what max_num_seqs requests at max_model_len need."""
    plan = plan_cache(10**9, slots_per_request=1, max_num_seqs=4, **SIZES)
    assert (plan.num_slots, plan.num_kv_blocks) == (4, 16)


def test_plan_too_small_budget_is_a_clear_error():
    """A budget below one max-length request raises ValueError naming memory_budget and the need."""
    with pytest.raises(ValueError, match=r"memory_budget=1399 .* needs 1400 bytes"):
        plan_cache(1399, slots_per_request=1, max_num_seqs=4, **SIZES)


def test_plan_overrides():
    """Explicit num_kv_blocks / num_slots are kept; too few blocks for one request is an error."""
    plan = plan_cache(10**6, slots_per_request=2, max_num_seqs=64, num_kv_blocks=5, num_slots=6, **SIZES)
    assert (plan.num_kv_blocks, plan.num_slots, plan.num_requests_fit) == (5, 6, 3)
    with pytest.raises(ValueError, match="num_kv_blocks=3"):
        plan_cache(10**6, slots_per_request=1, max_num_seqs=4, num_kv_blocks=3, **SIZES)


def test_plan_pure_mamba_model():
    """A model without attention (0 bytes per block) still gets block ids for every request."""
    plan = plan_cache(5000, slots_per_request=1, max_num_seqs=64, **{**SIZES, "bytes_per_kv_block": 0})
    assert plan.num_slots == 5 and plan.num_kv_blocks == 20
