"""Async scheduling with speculative decoding: two request groups whose verify steps interleave
(LLMEngine._step_group). A group's verify runs on the device, its commit takes the accepted counts
there (runner.commit_async) and they are read back at the group's next turn, after the other group's
step was queued. Every output must equal the synchronous engine's (and plain greedy decoding's)."""

import functools
import json

import pytest
import torch
from conftest import TINY_HYBRID_BF16, requires_cuda
from spec_helpers import generate, make_llm, one_thread, plain_greedy, prompts, target  # noqa: F401 (autouse fixture)

from replayssm import LLM, SamplingParams
from replayssm.cache.block_pool import BlockPool
from replayssm.cache.slot_pool import SlotPool
from replayssm.engine.request import Request
from replayssm.engine.scheduler import Scheduler

SPEC = dict(num_speculative_tokens=3, max_num_seqs=4)


def _llm(interleave: bool, replayssm: bool = True, method: str = "ngram", **kw):
    llm = make_llm(replayssm=replayssm, speculative_method=method, async_scheduling=interleave, **SPEC, **kw)
    assert llm.engine.interleave == interleave
    return llm


def _groups(llm) -> set[int]:
    return {r.group for r in llm.engine._requests.values()}


@pytest.mark.parametrize("replayssm", [True, False])
def test_interleaved_greedy_equals_plain(replayssm, monkeypatch):
    """Six requests in two groups, ReplaySSM on (cursor commit on the device) and off (the live spec
    slot adopted when the counts come back): the plain greedy tokens, the pools whole at the end.
    Before each launch, the host mirror of the group's cursors equals the device's."""
    ps, ref = prompts() * 3, [list(t) for t in plain_greedy()] * 3
    llm = _llm(True, replayssm)
    runner, launch, checked = llm.engine.runner, llm.engine._launch, []

    def launch_checked(chunks, **kw):
        if replayssm:
            slots = [c.request.slots[0] for c in chunks]
            cache = runner.mamba_cache
            device = list(zip(cache.ring_start[slots].tolist(), cache.committed[slots].tolist()))
            assert [runner.cursors(s) for s in slots] == device, "host cursor mirror differs from the device"
            checked.append(len(slots))
        return launch(chunks, **kw)

    monkeypatch.setattr(llm.engine, "_launch", launch_checked)
    seen = set()
    for i, p in enumerate(ps):
        llm.engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    outs = {}
    while llm.engine.has_unfinished_requests():
        seen |= _groups(llm)
        for o in llm.engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        llm.engine.check_integrity()
    assert [outs[str(i)] for i in range(len(ps))] == ref
    assert seen == {0, 1}, "both groups ran"
    assert not replayssm or sum(checked) > 50
    m = llm.get_metrics()
    assert m["spec_verify_steps"] > 0 and m["num_running"] == 0
    pools = llm.engine.scheduler
    assert pools.block_pool.num_free == pools.block_pool.num_blocks
    assert pools.slot_pool.num_free == pools.slot_pool.num_slots


@pytest.mark.parametrize("replayssm", [True, False])
def test_interleaved_sampling_and_synthetic_equal_synchronous(replayssm):
    """Seeded sampling (rejection sampling keyed by seed and position) and the synthetic drafter
    (forced acceptance, keyed the same way): the tokens and the acceptance of the synchronous engine."""
    ps = prompts() * 3
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, ignore_eos=True, seed=3)
    assert generate(_llm(True, replayssm), params, ps) == generate(_llm(False, replayssm), params, ps)
    runs = []
    for interleave in (True, False):
        llm = _llm(interleave, replayssm, "synthetic", synthetic_acceptance_length=2.5)
        runs.append((generate(llm, ps=ps), llm.get_metrics()["spec_accepted_tokens"]))
    assert runs[0] == runs[1]


@functools.cache
def _preempt_prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 14, 26, 9, 22, 16)]


@pytest.mark.parametrize("replayssm", [True, False])
def test_interleaved_preemptions_keep_plain_output(replayssm):
    """Too few KV blocks for the running requests: groups preempt their own newest requests (never the
    other group's, whose step is in flight); tokens stay the plain ones."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = generate(make_llm(kv_block_size=4), params, _preempt_prompts())
    llm = make_llm(kv_block_size=4, num_kv_blocks=24, max_num_seqs=3, replayssm=replayssm, replay_window=8,
                   num_speculative_tokens=3, speculative_method="ngram", async_scheduling=True)
    assert llm.engine.interleave
    assert generate(llm, params, _preempt_prompts()) == ref
    assert llm.get_metrics()["num_preemptions"] > 0
    llm.engine.check_integrity()


def test_interleaved_abort_and_stop_in_flight():
    """A request aborted while its group's step is in flight (its row is dropped at completion, its
    slot may serve another request by then) and a stop token inside accepted drafts: the others keep
    the plain tokens, the stopped one ends at its stop."""
    ref = [list(t) for t in plain_greedy()]
    stop = ref[1][5]
    llm = _llm(True)
    eng = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"r{i}", prompts()[i % 2], greedy)
    stopping = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    eng.add_request("stop", prompts()[1], stopping)
    outs, aborted, steps = {}, False, 0
    while eng.has_unfinished_requests():
        if steps == 4 and not aborted:
            assert any(s is not None for s in eng._inflight), "a step is in flight"
            eng.abort_request("r2")
            aborted = True
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        eng.check_integrity()
        steps += 1
    assert outs["r2"].finish_reason == "abort"
    for i in (0, 1, 3):
        assert outs[f"r{i}"].token_ids == ref[i % 2]
    assert outs["stop"].token_ids == ref[1][: ref[1].index(stop) + 1] and outs["stop"].finish_reason == "stop"
    assert eng.scheduler.slot_pool.num_free == eng.scheduler.slot_pool.num_slots


def test_interleave_needs_a_host_drafter_and_no_prefix_caching():
    """Model drafters keep device state (MTP reads the target's hidden states) and prefix caching
    publishes checkpoints from the accepted counts before the commit: both stay synchronous."""
    assert not make_llm(async_scheduling=True, speculative_method="mtp", **SPEC).engine.interleave
    assert not make_llm(async_scheduling=True, speculative_method="ngram", enable_prefix_caching=True,
                        **SPEC).engine.interleave
    assert not make_llm(async_scheduling=True).engine.interleave  # no drafts: plain async scheduling
    assert make_llm(async_scheduling=True, speculative_method="ngram", **SPEC).engine.interleave


def test_scheduler_groups_preempt_inside_and_balance_admission():
    """schedule(group): admits into the group up to half the seats, preempts only the group's own
    requests, and never schedules the other group's."""
    sched = Scheduler(BlockPool(12), SlotPool(8), kv_block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = [Request(str(i), [7] * 8, SamplingParams(max_tokens=40), seed=0, arrival=i) for i in range(5)]
    for r in reqs:
        sched.add(r)
    out0 = sched.schedule(group=0)
    assert [c.request for c in out0.chunks] == reqs[:2] and {r.group for r in reqs[:2]} == {0}
    for c in out0.chunks:
        c.request.num_computed_tokens += c.num_tokens
    out1 = sched.schedule(group=1)
    assert [c.request for c in out1.chunks] == reqs[2:4] and {r.group for r in reqs[2:4]} == {1}
    for c in out1.chunks:
        c.request.num_computed_tokens += c.num_tokens
    # 4 running x 2 blocks = 8 of 12; grow group 0's requests past the pool: it preempts its own.
    for r in reqs[:2]:
        r.output_token_ids += [1] * 14
    out = sched.schedule(group=0)
    assert out.preempted == [reqs[1]] and [c.request for c in out.chunks] == [reqs[0]]
    assert all(r.group == 1 and r in sched.running for r in reqs[2:4])
    sched.check_integrity()


@requires_cuda
@pytest.mark.parametrize("replayssm", [True, False])
def test_interleaved_equals_synchronous_cuda_graphs(tmp_path, replayssm):
    """On CUDA with graph replay (the configuration it is for; the auto default turns it on): the
    tokens of the synchronous engine, for the n-gram drafter with seeded sampling and the synthetic
    drafter, with graphs replayed for the verify steps of both groups."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_HYBRID_BF16))
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 12, 7, 21, 3)]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True, seed=11)
    for method, extra in (("ngram", {}), ("synthetic", {"synthetic_acceptance_length": 3.1})):
        kw = dict(device="cuda", load_format="dummy", cuda_graphs=True, kv_block_size=4, replay_window=8,
                  max_model_len=96, max_num_seqs=8, replayssm=replayssm, num_speculative_tokens=3,
                  speculative_method=method, **extra)
        sync = LLM(str(tmp_path), async_scheduling=False, **kw)
        want = [o.token_ids for o in sync.generate(ps, params, use_tqdm=False)]
        llm = LLM(str(tmp_path), **kw)
        assert llm.engine.interleave
        assert [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)] == want, method
        assert llm.engine.runner.graphs.num_replays > 0 and llm.get_metrics()["spec_verify_steps"] > 0
        llm.engine.check_integrity()
