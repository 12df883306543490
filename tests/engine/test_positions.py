"""Token positions reach rotary attention on every engine path.

The tiny Nemotron-H runs with RoPE forced into its attention layers (a test-only ModelConfig
override: partial rotary, a small base so that near positions differ). Every path that computes a
token (one full prefill, chunked prefill, token-by-token decode, verify rows, prefix hits,
ReplaySSM on and off, async and interleaved steps, the drafters' own forwards) must then agree, and
the outputs must differ from the same weights without RoPE (so the positions are really used).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import cached_checkpoint
from conftest import requires_cuda

sys.path.insert(0, str(Path(__file__).parents[1] / "prefix"))
from prefix_helpers import OracleDrafter, one_thread  # noqa: E402, F401 (autouse fixture)

from replayssm import LLM, SamplingParams  # noqa: E402
from replayssm.engine.batch_inputs import RowView, build_inputs  # noqa: E402
from replayssm.engine.model_runner import ModelRunner, ScheduledRow  # noqa: E402
from replayssm.models.config import ModelConfig  # noqa: E402

ROPE = dict(rope_theta=50.0, rotary_dim=8)  # head_dim 16: the first 8 channels of each head turn
_FROM_HF = ModelConfig.from_hf.__func__
MAX_LEN, NEW, BLOCK = 96, 16, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _with_rope(cls, path):
    return dataclasses.replace(_FROM_HF(cls, path), **ROPE)


@pytest.fixture(autouse=True)
def rope(monkeypatch):
    """Every checkpoint loaded in these tests gets rotary attention."""
    monkeypatch.setattr(ModelConfig, "from_hf", classmethod(_with_rope))


def target() -> str:
    """The tiny Nemotron-H (Mamba, attention, MLP, MoE) with mtp.* weights."""
    return cached_checkpoint("nemotron_h", mtp=True)[0]


def prompts() -> list[list[int]]:
    """A short prompt, a long one, and a repetitive one (the n-gram drafter finds matches in it)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (6,), generator=g).tolist(),
            torch.randperm(253, generator=g)[:40].add(3).tolist(),
            list(range(20, 32)) * 3]


def make_llm(**kw) -> LLM:
    return LLM(target(), device="cpu", max_model_len=MAX_LEN, kv_block_size=BLOCK, **kw)


def generate(llm: LLM, ps: list[list[int]] | None = None) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(ps or prompts(), GREEDY, use_tqdm=False)]


@functools.cache
def _reference() -> tuple[tuple[str, tuple[int, ...]], ...]:
    outs = make_llm().generate(prompts(), GREEDY, use_tqdm=False)
    return tuple((o.request_id, tuple(o.token_ids)) for o in outs)


def reference() -> list[list[int]]:
    """Greedy tokens of the plainest path: whole prompts in one prefill, then one token per step."""
    return [list(t) for _, t in _reference()]


def oracle(seed: int) -> OracleDrafter:
    """Drafts the reference continuation with a random number of them right: verify rows accept."""
    return OracleDrafter({rid: list(t) for rid, t in _reference()}, seed)


def test_build_inputs_positions_count_cached_tokens():
    """Each packed token's position is start_pos + its offset in the row, in packed order (prefill
    rows, then decode and verify rows, then forced one-token chunks)."""
    rows = [RowView(0, [5, 6, 7], 0, [0], 0, 1, None, False, False),
            RowView(1, [8], 12, [1, 2, 3, 4], 1, 1, None, True, False),
            RowView(2, [9, 10, 11, 12], 30, list(range(5, 14)), 2, 4, None, True, False),
            RowView(3, [13, 14], 8, [14, 15, 16], 3, 1, None, False, False),
            RowView(4, [15], 3, [17], 4, 1, None, True, True)]
    batch = build_inputs(rows, block_size=BLOCK, device=torch.device("cpu"), baseline=False)
    assert batch.positions.dtype == torch.int64
    assert batch.positions.tolist() == [0, 1, 2, 8, 9, 12, 30, 31, 32, 33, 3]


def test_rotary_layers_are_built_from_the_config():
    """rope_theta > 0 gives every attention layer (the MTP head's too) one shared rotary table."""
    llm = make_llm(num_speculative_tokens=2, speculative_method="mtp")
    model, mtp = llm.engine.runner.model, llm.engine.spec.proposer.head.mtp
    rotaries = [m.rotary for m in (*model.modules(), *mtp.modules()) if type(m).__name__ == "Attention"]
    assert len(rotaries) == 3 and all(r is not None and r.rotary_dim == 8 for r in rotaries)
    assert len({id(r.cos_sin(torch.device("cpu"))) for r in rotaries}) == 1


def _logits(runner: ModelRunner, ids: list[int], plan: list[tuple[str, int]]) -> torch.Tensor:
    """Run `ids` as the plan's prefill chunks and decode rows (every draft accepted); logits of
    every token. Baseline verify rows write their per-token states to the other half of the slots."""
    table = list(range(-(-len(ids) // BLOCK)))
    out, pos, slot = [], 0, 0
    for kind, n in plan:
        spec = None
        if kind == "decode" and n > 1 and not runner.replayssm:
            spec = [s for s in range(8) if (s < 4) != (slot < 4)][:n]
        row = ScheduledRow(ids[pos:pos + n], pos, table, slot, kind == "prefill", num_logits=n,
                           spec_slots=spec)
        out.append(runner.execute([row]))
        slot = runner.commit([row], [n])[0]
        pos += n
    assert pos == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("replayssm", [True, False])
def test_every_runner_path_gives_the_full_forward_logits(replayssm, monkeypatch):
    """One prefill of 20 tokens == prefill + token-by-token decode == prefill chunks + verify rows of
    4 + a decode row, ReplaySSM on and off; without RoPE the logits differ."""
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    kw = dict(num_kv_blocks=16, kv_block_size=BLOCK, num_slots=8, max_num_seqs=4, replay_window=4,
              num_speculative_tokens=3, replayssm=replayssm)
    full = _logits(ModelRunner(target(), **kw), ids, [("prefill", 20)])
    plans = ([("prefill", 7)] + [("decode", 1)] * 13,
             [("prefill", 5), ("prefill", 6), ("decode", 4), ("decode", 1), ("decode", 4)])
    for plan in plans:
        torch.testing.assert_close(_logits(ModelRunner(target(), **kw), ids, plan), full,
                                   rtol=1e-4, atol=1e-4, msg=str(plan))
    monkeypatch.setattr(ModelConfig, "from_hf", classmethod(_FROM_HF))
    plain = _logits(ModelRunner(target(), **kw), ids, [("prefill", 20)])
    torch.testing.assert_close(plain[0], full[0], rtol=1e-4, atol=1e-4)  # position 0 does not turn
    assert (plain[4:] - full[4:]).abs().amax(-1).min() > 1e-2


def test_rotary_changes_the_greedy_tokens(monkeypatch):
    """The same weights without RoPE decode other tokens: the positions reach the model."""
    ref = reference()
    monkeypatch.setattr(ModelConfig, "from_hf", classmethod(_FROM_HF))
    assert generate(make_llm()) != ref


@pytest.mark.parametrize("kw", [
    dict(replayssm=False),
    dict(max_num_batched_tokens=8, max_num_seqs=2),  # chunked prefill, chunks next to decode rows
    dict(async_scheduling=True),  # each decode step launched before the last one's tokens are read
], ids=["replayssm-off", "chunked", "async"])
def test_engine_paths_equal_plain_greedy(kw):
    """Without speculation: the plain path's tokens."""
    assert generate(make_llm(**kw)) == reference()


def test_preempted_requests_restart_at_position_zero():
    """Too few KV blocks for the three requests: preempted ones recompute from position 0 and still
    give the plain tokens."""
    llm = make_llm(num_kv_blocks=24)
    assert generate(llm) == reference()
    assert llm.get_metrics()["num_preemptions"] > 0


@pytest.mark.parametrize("replayssm", [True, False])
def test_prefix_hits_equal_plain_greedy(replayssm):
    """Prompts sharing a long prefix with one already served start from a cached checkpoint (their
    first positions never run again) and still give the plain tokens."""
    ps = prompts()
    llm = make_llm(enable_prefix_caching=True, replayssm=replayssm)
    assert generate(llm) == reference()
    again = [p[:-1] + [p[-1] % 200 + 3] for p in ps] + [ps[1] + ps[0]]
    llm_ref = make_llm(replayssm=replayssm)
    assert generate(llm, again) == generate(llm_ref, again)
    assert llm.get_metrics()["prefix_cache_hit_tokens"] >= 32


@pytest.mark.parametrize("kw", [
    dict(),
    dict(replayssm=False),
    dict(async_scheduling=True),  # two interleaved request groups
    dict(enable_prefix_caching=True),
], ids=["replayssm", "baseline", "interleaved", "prefix"])
def test_verify_rows_equal_plain_greedy(kw):
    """Verify rows at positions c .. c + 3 (k = 3, drafts from the reference, a random number of them
    right): the plain greedy tokens, with drafts accepted."""
    llm = make_llm(num_speculative_tokens=3, speculative_method="ngram", **kw)
    assert llm.engine.interleave == bool(kw.get("async_scheduling"))
    llm.engine.spec.proposer = oracle(seed=5)
    assert generate(llm) == reference()
    assert llm.get_metrics()["spec_accepted_tokens"] > 10


def test_mtp_drafts_keep_plain_greedy():
    """The rotary MTP head drafts (its own forward at the target's positions): the plain tokens."""
    llm = make_llm(num_speculative_tokens=3, speculative_method="mtp")
    assert generate(llm) == reference()
    assert llm.get_metrics()["spec_verify_steps"] > 0


@pytest.mark.parametrize("replayssm", [True, False])
def test_draft_model_identical_to_target_accepts_its_drafts(replayssm):
    """A draft model with the target's weights (its own runner and positions) proposes the target's
    own greedy tokens: the plain output, nearly every draft accepted."""
    llm = make_llm(num_speculative_tokens=3, speculative_method="draft", draft_model=target(),
                   replayssm=replayssm)
    assert generate(llm) == reference()
    m = llm.get_metrics()
    assert m["spec_accepted_tokens"] >= 0.9 * m["spec_draft_tokens"] > 0


def test_synthetic_verify_rows_agree_across_paths():
    """Synthetic drafts (forced acceptance, k = 3): ReplaySSM on, off and interleaved give one output."""
    kw = dict(num_speculative_tokens=3, speculative_method="synthetic", synthetic_acceptance_length=2.5)
    runs = [generate(make_llm(**kw, **extra)) for extra in
            (dict(), dict(replayssm=False), dict(async_scheduling=True))]
    assert runs[0] == runs[1] == runs[2]


def test_mtp_head_positions_match_one_call():
    """The rotary MTP head gives the same output over a sequence in one call as position by position."""
    mtp = make_llm(num_speculative_tokens=2, speculative_method="mtp").engine.spec.proposer.head
    g = torch.Generator().manual_seed(3)
    T, H = 11, 64
    toks, hid = torch.randint(0, 256, (T,), generator=g).tolist(), torch.randn(T, H, generator=g)
    table = [5, 2, 7]
    one_out, _ = mtp._forward([(0, toks, hid, table)])
    for i in range(T):
        out, _ = mtp._forward([(i, [toks[i]], hid[i:i + 1], table)])
    torch.testing.assert_close(out, one_out, rtol=1e-4, atol=1e-4)
    shifted, _ = mtp._forward([(3, toks, hid, [5, 2, 7, 9])])  # the same tokens 3 positions on
    assert (shifted - one_out).abs().max() > 1e-2


def test_max_model_len_past_the_rotary_table_is_refused():
    """A rotary model serves at most max_position_embeddings tokens: a longer max_model_len is a
    ValueError naming both, and a runner row past the table is refused."""
    with pytest.raises(ValueError, match="max_model_len=1024 exceeds the model's max_position_embeddings"):
        LLM(target(), device="cpu", max_model_len=1024)
    runner = ModelRunner(target(), num_kv_blocks=200, kv_block_size=BLOCK, num_slots=2, max_num_seqs=2)
    row = ScheduledRow([3], 512, list(range(129)), 0, False)
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        runner.execute([row])


TINY_BF16 = {
    "architectures": ["NemotronHForCausalLM"], "vocab_size": 256, "hidden_size": 128,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
    "chunk_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 192, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64, "hybrid_override_pattern": "M*EM-*",
    "max_position_embeddings": 512,
}


@requires_cuda
@pytest.mark.parametrize("dtype,k", [("float32", 0), ("bfloat16", 2)])
def test_graph_steps_equal_eager_with_rotary(tmp_path, dtype, k):
    """CUDA-graph replays (static positions buffer, padding rows) give the eager steps' logits with
    rotary attention: plain decode in fp32, ReplaySSM verify rows in bf16."""
    from test_cuda_graph import run_schedule

    # CUDA graphs take MoE layers in bf16 only (the sync-free grouped GEMM): fp32 runs without them.
    pattern = TINY_BF16["hybrid_override_pattern"] if dtype == "bfloat16" else "M*-M-*"
    (tmp_path / "config.json").write_text(json.dumps({**TINY_BF16, "dtype": dtype,
                                                      "hybrid_override_pattern": pattern}))
    kw = dict(device="cuda", dtype=dtype, load_format="dummy", num_slots=12, max_num_seqs=6,
              num_kv_blocks=40, kv_block_size=4, num_speculative_tokens=k)
    graph = ModelRunner(tmp_path, cuda_graphs=True, **kw)
    eager = ModelRunner(tmp_path, cuda_graphs=False, **kw)
    assert graph.model_config.rope_theta == ROPE["rope_theta"]
    got, want = run_schedule(graph, 1 + k), run_schedule(eager, 1 + k)
    assert graph.graphs.num_replays == 6
    for g, w in zip(got, want):
        if dtype == "float32":
            assert torch.equal(g.argmax(-1), w.argmax(-1))
            assert (g - w).abs().max() < 1e-3 * w.abs().max()
        else:
            assert (g - w).norm() / w.norm() < 2e-2
