import pytest

from replayssm.config import CacheConfig, EngineConfig, SchedulerConfig
from replayssm.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),  # more alternatives than MAX_LOGPROBS
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    """Each invalid SamplingParams value raises ValueError naming its field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalization():
    """A single stop string becomes a list; temperature 0 means greedy."""
    p = SamplingParams(temperature=0.0, stop="END")
    assert p.stop == ["END"] and p.greedy and not SamplingParams().greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kv_block_size": 0}, "kv_block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"state_dtype": "int8"}, "state_dtype"),
        ({"dtype": "float64"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"replay_window": 0}, "replay_window"),
        ({"num_speculative_tokens": 16}, "num_speculative_tokens"),
        ({"memory_budget": 0}, "memory_budget"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"no_such_flag": 1}, "no_such_flag"),
        ({"host_threads": -1}, "host_threads"),
        ({"replayssm": "yes"}, "replayssm"),
    ],
)
def test_bad_engine_args_name_the_field(kwargs, field):
    """Flat engine keyword arguments are routed to the sub-configs and validated with the field's name."""
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs("some/path", **kwargs)


def test_window_bounds_drafts_only_with_replayssm():
    """1 + k tokens must fit the ReplaySSM ring; the baseline keeps no ring, so any window goes."""
    with pytest.raises(ValueError, match="replay_window"):
        EngineConfig.from_kwargs("p", num_speculative_tokens=3, replay_window=2)
    c = EngineConfig.from_kwargs("p", num_speculative_tokens=3, replay_window=2, replayssm=False)
    assert c.spec.num_speculative_tokens == 3


@pytest.mark.parametrize("kw, on", [({}, True), ({"replayssm": False}, False)], ids=["default", "off"])
def test_replayssm_is_on_by_default_for_mamba2(kw, on):
    """replayssm unset is on for a Nemotron-H (Mamba-2) model; an explicit False is kept. The engine's
    config and runner hold the bool."""
    from checkpoints import cached_checkpoint

    from replayssm.engine.llm_engine import LLMEngine

    path, _ = cached_checkpoint("nemotron_h")
    engine = LLMEngine(EngineConfig.from_kwargs(path, device="cpu", max_num_seqs=2, max_model_len=64, **kw))
    assert engine.config.replayssm is on and engine.runner.replayssm is on


def test_engine_kwargs_route_to_sub_configs():
    """from_kwargs places each flat keyword in the sub-config that owns it."""
    c = EngineConfig.from_kwargs(
        "p", max_num_seqs=3, kv_block_size=8, num_speculative_tokens=2, replayssm=False
    )
    assert c.scheduler == SchedulerConfig(max_num_seqs=3)
    assert c.cache == CacheConfig(kv_block_size=8)
    assert c.spec.num_speculative_tokens == 2 and not c.replayssm


def test_cpu_engine_keeps_torch_threads():
    """host_threads applies to engines on CUDA only: a CPU engine's model runs on torch's threads."""
    import torch

    from replayssm.engine.llm_engine import LLMEngine

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        LLMEngine(EngineConfig.from_kwargs("demo", device="cpu", host_threads=1, max_num_seqs=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_replay_stagger_reaches_the_runner():
    """replay_stagger (staggered checkpoints) must be a bool, and the engine's runner takes it."""
    from replayssm.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="replay_stagger"):
        EngineConfig.from_kwargs("p", replay_stagger="yes")
    for stagger in (True, False):
        engine = LLMEngine(EngineConfig.from_kwargs("demo", device="cpu", max_num_seqs=2, replay_window=8,
                                                    replay_stagger=stagger))
        assert engine.runner._stagger_span == (8 if stagger else 0)
