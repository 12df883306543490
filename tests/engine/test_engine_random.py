"""Random request lifecycles on the fake runner: tight memory, odd budgets, aborts."""

from engine_drive import drive
from fake_runner import FakeRunner, write_fake_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replayssm import LLM, SamplingParams

_CKPT: list[str] = []


def _ckpt(tmp_path_factory) -> str:
    if not _CKPT:
        _CKPT.append(write_fake_checkpoint(str(tmp_path_factory.mktemp("fake_random"))))
    return _CKPT[0]


request_st = st.tuples(
    st.lists(st.integers(3, 99), min_size=1, max_size=40),  # prompt
    st.integers(1, 30),  # max_tokens
    st.sampled_from([0.0, 0.7, 1.3]),  # temperature
    st.integers(0, 2**31),  # seed
)


def _run(path, reqs, aborts, **kw):
    llm = LLM(path, runner_cls=FakeRunner, device="cpu", max_model_len=80, kv_block_size=4, **kw)
    done = drive(llm, [(prompt, SamplingParams(temperature=temp, seed=seed, max_tokens=max_tokens))
                       for prompt, max_tokens, temp, seed in reqs], aborts)
    return done, llm.get_metrics()


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=8),
    budget=st.sampled_from([1, 3, 8, 64]),
    memory=st.sampled_from([3100, 5200, 9000]),
    abort_steps=st.dictionaries(st.integers(0, 20), st.lists(st.integers(0, 7), max_size=2), max_size=3),
    async_on=st.booleans(),
)
def test_random_lifecycles_match_a_roomy_run(tmp_path_factory, reqs, budget, memory, abort_steps, async_on):
    """Any workload under tight memory and token budgets, with aborts, with or without async scheduling,
    finishes every request, and each request that was not aborted has exactly the tokens of an
    unconstrained synchronous run."""
    path = _ckpt(tmp_path_factory)
    aborts = {s: [str(i) for i in ids] for s, ids in abort_steps.items()}
    tight, metrics = _run(path, reqs, aborts, memory_budget=memory, max_num_batched_tokens=budget,
                          async_scheduling=async_on)
    roomy, _ = _run(path, reqs, {})
    assert set(tight) == set(roomy) == {str(i) for i in range(len(reqs))}
    for rid, out in tight.items():
        if out.finish_reason == "abort":
            assert out.token_ids == roomy[rid].token_ids[: len(out.token_ids)]
        else:
            assert out.token_ids == roomy[rid].token_ids and out.finish_reason == roomy[rid].finish_reason
    assert metrics["num_requests_finished"] == len(reqs)
