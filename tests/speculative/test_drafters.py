"""Drafter units: n-gram lookup, the synthetic acceptance law, the MTP head's KV consistency, CLI flags."""

import torch
from spec_helpers import make_llm, one_thread, target  # noqa: F401 (autouse fixture)

from replayssm.cli import build_parser
from replayssm.config_flags import engine_kwargs
from replayssm.engine.request import Request
from replayssm.sampling_params import SamplingParams
from replayssm.speculative.ngram import ngram_lookup
from replayssm.speculative.synthetic import SyntheticProposer, acceptance_probability


def test_ngram_lookup_prefers_longest_and_latest_match():
    """The longest suffix n-gram wins, its latest earlier occurrence is used, drafts are capped at k."""
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_lookup(toks, 2, 1, 3) == [7, 8]  # "2 3" follows "1 2 3 7 8" latest
    assert ngram_lookup(toks, 5, 1, 1) == [7, 8, 5, 2, 3]  # "3" latest at index 6
    assert ngram_lookup([4, 5, 6], 3, 1, 4) == []
    assert ngram_lookup(toks, 2, 3, 4) == []  # "5 2 3" never occurred before


def test_ngram_index_equals_the_plain_scan():
    """The incremental n-gram index proposes what the plain scan finds, step after step."""
    import random

    from replayssm.speculative.ngram import NgramProposer

    rng = random.Random(0)
    for ngram_min, ngram_max in ((1, 4), (2, 3)):
        prop = NgramProposer(ngram_min, ngram_max)
        r = Request("a", [rng.randrange(6) for _ in range(9)], SamplingParams(), seed=0, arrival=0)
        for _ in range(60):
            n = rng.randint(1, 5)
            got = prop.propose([r], [n])[0].tokens
            assert got == ngram_lookup(r.prompt_token_ids + r.output_token_ids, n, ngram_min, ngram_max)
            r.output_token_ids.extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))
        prop.release(r)
        assert not prop._index


def test_synthetic_drafter_hits_the_configured_mean_length():
    """k = 3 at mean length 3.1151: seeded draws average 3.1151 tokens per verify step."""
    alpha = acceptance_probability(3.1151, 3)
    assert abs(1 + alpha + alpha**2 + alpha**3 - 3.1151) < 1e-9
    prop = SyntheticProposer(3.1151, 3, vocab_size=256, seed=0)
    assert prop.produces_model_output is False
    reqs = [Request(f"r{i}", [5, 6], SamplingParams(), seed=i, arrival=i) for i in range(20000)]
    drafts = prop.propose(reqs, [3] * len(reqs))
    mean = sum(d.forced_accepted + 1 for d in drafts) / len(drafts)
    assert abs(mean - 3.1151) < 0.03  # about 4 standard errors at 20000 draws
    assert all(len(d.tokens) == 3 and 0 <= d.forced_accepted <= 3 for d in drafts)
    assert prop.propose(reqs[:5], [3] * 5) == drafts[:5]


def test_synthetic_outputs_are_flagged_as_not_model_output():
    """Synthetic mode marks every output and the metrics as not the model's output."""
    llm = make_llm(
        num_speculative_tokens=3, speculative_method="synthetic", synthetic_acceptance_length=3.1151
    )
    outs = llm.generate(
        [[5, 6, 7]] * 3, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    assert all(o.synthetic_spec for o in outs) and all(len(o.token_ids) == 30 for o in outs)
    m = llm.get_metrics()
    assert m["spec_output_is_model_output"] is False
    assert 2.0 < m["spec_mean_acceptance_length"] < 4.0


def test_mtp_head_is_kv_consistent():
    """The MTP head gives the same output over a sequence in one call as position by position."""
    llm = make_llm(num_speculative_tokens=2, speculative_method="mtp")
    mtp = llm.engine.spec.proposer.head
    g = torch.Generator().manual_seed(3)
    T, H = 11, llm.engine.model_config.hidden_size
    toks, hid, table = (
        torch.randint(0, 256, (T,), generator=g).tolist(),
        torch.randn(T, H, generator=g),
        [5, 2],
    )
    one_out, one_logits = mtp._forward([(0, toks, hid, table)])
    for i in range(T):
        out, logits = mtp._forward([(i, [toks[i]], hid[i : i + 1], table)])
    torch.testing.assert_close(out, one_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, one_logits, rtol=1e-4, atol=1e-4)


def test_mtp_weights_come_from_the_checkpoint():
    """Every MTP parameter is read from the mtp.* tensors (per-expert tensors stacked)."""
    from safetensors.torch import load_file

    llm = make_llm(num_speculative_tokens=1, speculative_method="mtp")
    params = dict(llm.engine.spec.proposer.head.mtp.named_parameters())
    file = load_file(f"{target()}/model.safetensors")
    assert torch.equal(params["layers.0.eh_proj.weight"], file["mtp.layers.0.eh_proj.weight"])
    assert torch.equal(
        params["layers.1.mixer.experts.up_proj"][3], file["mtp.layers.1.mixer.experts.3.up_proj.weight"]
    )
    assert torch.equal(params["layers.1.final_layernorm.weight"], file["mtp.layers.1.final_layernorm.weight"])


def test_mtp_needs_mtp_weights(tmp_path):
    """speculative_method='mtp' on a checkpoint without MTP layers is a clear ValueError."""
    import pytest
    from checkpoints import cached_checkpoint

    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        make_llm(cached_checkpoint("mamba2")[0], num_speculative_tokens=1, speculative_method="mtp")


def test_cli_spec_flags_reach_the_engine():
    """--num-speculative-tokens / --speculative-method / drafter flags map onto the spec config."""
    args = build_parser().parse_args(
        [
            "generate",
            "--model",
            "demo",
            "--prompt",
            "x",
            "--num-speculative-tokens",
            "3",
            "--speculative-method",
            "synthetic",
            "--synthetic-acceptance-length",
            "3.1151",
            "--ngram-max",
            "5",
            "--draft-model",
            "d",
        ]
    )
    kw = engine_kwargs(args)
    assert kw["num_speculative_tokens"] == 3 and kw["speculative_method"] == "synthetic"
    assert kw["synthetic_acceptance_length"] == 3.1151 and kw["ngram_max"] == 5 and kw["draft_model"] == "d"
    assert (
        build_parser().parse_args(["generate", "--model", "m", "--prompt", "x"]).speculative_method == "ngram"
    )


def test_planner_counts_the_mtp_kv_cache():
    """The MTP head's attention KV (same block ids) is part of every planned KV block."""
    plain = make_llm().engine.plan.bytes_per_kv_block
    mtp = make_llm(num_speculative_tokens=1, speculative_method="mtp").engine.plan.bytes_per_kv_block
    assert mtp * 2 == plain * 3  # the target has 2 attention layers, its MTP head 1


def test_cli_generate_marks_synthetic_output(capsys):
    """`generate --speculative-method synthetic --json` flags each output and the summary line."""
    import json

    from replayssm.cli import main

    argv = [
        "generate",
        "--model",
        "demo",
        "--device",
        "cpu",
        "--prompt",
        "Hi",
        "--max-tokens",
        "8",
        "--num-speculative-tokens",
        "3",
        "--speculative-method",
        "synthetic",
        "--json",
        "--no-progress",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["synthetic_spec"] is True
    assert "NOT the model's output" in err
