"""The sampling parameters end to end through LLMEngine on the deterministic fake runner: each output
equals a step-by-step reference loop that applies transformers' processors to the fake model's logits,
with and without async scheduling (whose steps take their last token on the device)."""

import pytest
import torch
from fake_runner import FakeRunner, reference_logits, write_fake_checkpoint
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from replayssm import LLM, SamplingParams

EOS = 2  # the fake checkpoint's eos_token_id


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_fake_checkpoint(str(tmp_path_factory.mktemp("fake")))


def make_llm(path, **kw):
    return LLM(
        path, runner_cls=FakeRunner, **{"device": "cpu", "max_model_len": 96, "kv_block_size": 4, **kw}
    )


def reference(prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding under the fake model with the processors applied by transformers / in float64."""
    seq, out = list(prompt), []
    while len(out) < p.max_tokens:
        x = reference_logits(seq).double()[None]
        if p.repetition_penalty != 1.0:
            x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([seq]), x)
        count = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=x.shape[-1]).double()
        x = x - p.frequency_penalty * count - p.presence_penalty * (count > 0).double()
        for t, b in (p.logit_bias or {}).items():
            x[0, t] += b
        if len(out) < p.min_tokens:
            x[0, EOS] = float("-inf")
        tok = int(x.argmax())
        seq.append(tok)
        out.append(tok)
        if tok == EOS and not p.ignore_eos:
            break
    return out


CASES = [
    SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.8, ignore_eos=True),
    SamplingParams(
        temperature=0.0, max_tokens=24, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True
    ),
    SamplingParams(
        temperature=0.0,
        max_tokens=24,
        repetition_penalty=0.9,
        frequency_penalty=0.7,
        logit_bias={5: 2.0, 6: -3.0},
        ignore_eos=True,
    ),
    SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, logit_bias={EOS: 100.0}),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),  # no processor, in the same batch
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_processed_greedy_outputs_match_the_reference(ckpt, async_scheduling):
    """Penalties, logit_bias and min_tokens give the reference's tokens, alone in a batch of mixed rows,
    also when a step is launched before the previous step's tokens reach the host."""
    llm = make_llm(ckpt, async_scheduling=async_scheduling)
    assert llm.engine.async_scheduling is async_scheduling
    ps = [[(7 * i + 3 * j) % 90 + 5 for j in range(4 + i)] for i in range(len(CASES))]
    outs = llm.generate(ps, CASES, use_tqdm=False)
    if async_scheduling:
        assert llm.get_metrics()["num_ahead_steps"] > 0
    for prompt, params, out in zip(ps, CASES, outs):
        assert out.token_ids == reference(prompt, params)
    assert len(outs[3].token_ids) == 7 and outs[3].token_ids[-1] == EOS and outs[3].finish_reason == "stop"


def test_min_tokens_defers_stop_strings(ckpt):
    """A stop string cannot end generation before min_tokens tokens exist."""
    llm = make_llm(ckpt)
    p = [5, 9, 13]
    full = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)[
        0
    ]
    stop = full.text[:2]
    early = llm.generate(
        [p], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0]
    late = llm.generate(
        [p],
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop], min_tokens=8),
        use_tqdm=False,
    )[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 8
    assert len(late.token_ids) >= 8 and late.token_ids[: len(early.token_ids)] == early.token_ids


def test_include_stop_str_in_output(ckpt):
    """include_stop_str_in_output keeps the matched stop string, and a stop token's text."""
    llm = make_llm(ckpt)
    p = [5, 9, 13]
    full = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)[
        0
    ]
    stop = full.text[3:5]
    cut = full.text.index(stop)
    kept, dropped = (
        llm.generate(
            [p],
            SamplingParams(
                temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=inc
            ),
            use_tqdm=False,
        )[0]
        for inc in (True, False)
    )
    assert kept.text == full.text[: cut + len(stop)] and dropped.text == full.text[:cut]
    ids, decode = full.token_ids, llm.tokenizer.decode
    tok = next(t for i, t in enumerate(ids) if t not in ids[:i] and decode(ids[: i + 1]) != decode(ids[:i]))
    kept, dropped = (
        llm.generate(
            [p],
            SamplingParams(
                temperature=0.0,
                max_tokens=20,
                ignore_eos=True,
                stop_token_ids=[tok],
                include_stop_str_in_output=inc,
            ),
            use_tqdm=False,
        )[0]
        for inc in (True, False)
    )
    first = full.token_ids.index(tok)
    assert kept.token_ids == dropped.token_ids == full.token_ids[: first + 1]
    assert kept.text.startswith(dropped.text) and kept.text != dropped.text


def test_logit_bias_outside_the_vocabulary_is_refused(ckpt):
    """A logit_bias token id past the vocabulary is a ValueError naming logit_bias."""
    with pytest.raises(ValueError, match="logit_bias"):
        make_llm(ckpt).generate([[5, 6]], SamplingParams(logit_bias={100: 1.0}), use_tqdm=False)


def test_empty_text_prompt_is_refused(ckpt):
    """generate("") raises ValueError, as the server's 400 does, instead of running a one-token prompt."""
    with pytest.raises(ValueError, match="prompt is empty"):
        make_llm(ckpt).generate("", use_tqdm=False)
