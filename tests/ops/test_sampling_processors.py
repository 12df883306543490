"""The logits processors (ops/sampling.py, engine/logits_inputs.py) against independent references on
the same logits: transformers' logits processors and warpers, or OpenAI's float64 formula."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from replayssm.engine.logits_inputs import build_logits_processors
from replayssm.engine.request import Request
from replayssm.ops.sampling import SamplingTensors, apply_logits_processors, apply_min_p, sample
from replayssm.sampling_params import SamplingParams
from replayssm.speculative.verify import target_probs

V = 40
EOS = [2, 5]


def _request(params: SamplingParams, prompt: list[int], output: list[int], seed: int = 0) -> Request:
    r = Request("r", list(prompt), params, seed=seed, arrival=0)
    r.output_token_ids.extend(output)
    if params.min_tokens:
        r.min_tokens_stop_ids = sorted({*([] if params.ignore_eos else EOS), *(params.stop_token_ids or [])})
    return r


def _histories(b: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, V, (int(n),), generator=g).tolist(),
            torch.randint(0, V, (int(m),), generator=g).tolist(),
        )
        for n, m in torch.randint(1, 12, (b, 2), generator=g)
    ]


def _processed(logits: torch.Tensor, requests: list[Request], **kw) -> torch.Tensor:
    return apply_logits_processors(logits, build_logits_processors(requests, V, logits.device, **kw))


def test_repetition_penalty_matches_transformers():
    """repetition_penalty changes what RepetitionPenaltyLogitsProcessor changes over prompt + output."""
    logits = torch.randn(6, V) * 3
    hist = _histories(6)
    pens = [1.3, 0.7, 1.0, 2.0, 1.1, 1.5]
    reqs = [_request(SamplingParams(repetition_penalty=p), a, b) for p, (a, b) in zip(pens, hist)]
    got = _processed(logits, reqs)
    for i, (p, (a, b)) in enumerate(zip(pens, hist)):
        ref = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([a + b]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], ref, rtol=0, atol=0)


def test_presence_frequency_match_the_openai_formula():
    """logit - frequency * count - presence * (count > 0), counts over the output only, in float64."""
    logits = torch.randn(5, V) * 3
    hist = _histories(5, seed=1)
    pf = [(0.5, 0.0), (0.0, 1.5), (-1.0, 0.3), (2.0, -2.0), (0.4, 0.4)]
    reqs = [
        _request(SamplingParams(presence_penalty=p, frequency_penalty=f), a, b)
        for (p, f), (a, b) in zip(pf, hist)
    ]
    got = _processed(logits, reqs)
    for i, ((p, f), (_, out)) in enumerate(zip(pf, hist)):
        count = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=V).double()
        ref = logits[i].double() - f * count - p * (count > 0).double()
        torch.testing.assert_close(got[i].double(), ref, rtol=0, atol=1e-5)


def test_logit_bias_matches_sequence_bias():
    """logit_bias adds each token's bias, as SequenceBiasLogitsProcessor does for one-token sequences."""
    logits = torch.randn(2, V)
    bias = {3: 5.0, 17: -100.0, 39: 0.25}
    reqs = [_request(SamplingParams(logit_bias=bias), [1], []), _request(SamplingParams(), [1], [])]
    got = _processed(logits, reqs)
    ref = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(
        torch.tensor([[1]]), logits[:1].clone()
    )
    torch.testing.assert_close(got[0], ref[0])
    assert torch.equal(got[1], logits[1])  # a row without processors is untouched


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_tokens_matches_min_new_tokens(generated):
    """min_tokens=3 masks eos and stop_token_ids while fewer than 3 tokens exist, as
    MinNewTokensLengthLogitsProcessor does; ignore_eos leaves eos alone."""
    logits = torch.randn(2, V)
    prompt = [7, 8, 9]
    out = list(range(10, 10 + generated))
    reqs = [
        _request(SamplingParams(min_tokens=3, stop_token_ids=[11]), prompt, out),
        _request(SamplingParams(min_tokens=3, stop_token_ids=[11], ignore_eos=True), prompt, out),
    ]
    got = _processed(logits, reqs)
    for i, banned in enumerate((EOS + [11], [11])):
        ref = MinNewTokensLengthLogitsProcessor(len(prompt), 3, banned)(
            torch.tensor([prompt + out]), logits[i : i + 1].clone()
        )
        assert torch.equal(got[i], ref[0])


def test_min_p_matches_transformers():
    """apply_min_p drops what MinPLogitsWarper drops."""
    logits = torch.randn(8, V) * 2
    min_p = torch.tensor([0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 0.9, 1.0])
    got = apply_min_p(logits, min_p)
    for i, m in enumerate(min_p.tolist()):
        ref = MinPLogitsWarper(m)(None, logits[i : i + 1].clone())[0] if m > 0 else logits[i]
        assert torch.equal(got[i], ref)


def test_history_extends_with_extra_and_fed_tokens():
    """Drafts (extra) and a device token (fed) count as output, as if the request had appended them."""
    logits = torch.randn(3, V)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)
    short = _request(params, [1, 2], [3])
    full = [
        _request(params, [1, 2], [3, 4, 30]),
        _request(params, [1, 2], [3, 31]),
        _request(params, [1, 2], [3]),
    ]
    fed = torch.tensor([0, 30, 31])
    got = _processed(logits, [short, short, short], extra=[[4, 30], [], []], fed=(fed, [None, 2, None]))
    want = _processed(logits, full)
    assert torch.equal(got, want)


def _hf_chain(logits_row, ids, p: SamplingParams) -> torch.Tensor:
    """transformers' processors then warpers, in transformers' order, on one row (1, V)."""
    x = logits_row.clone()[None]
    ids = torch.tensor([ids])
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0.0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x[0].softmax(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, repetition_penalty=1.4, min_p=0.05),
        SamplingParams(temperature=1.3, repetition_penalty=0.8, top_k=12, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=0.5, top_p=0.8, min_p=0.2),
    ],
)
def test_verify_target_distribution_is_the_processed_one(params):
    """speculative verify's p (target_probs of the processed logits) equals the softmax of transformers'
    processor and warper chain."""
    logits = torch.randn(4, V) * 2
    hist = _histories(4, seed=3)
    reqs = [_request(params, a, b) for a, b in hist]
    x = _processed(logits, reqs)
    n = x.shape[0]
    got = target_probs(
        x,
        torch.full((n,), params.temperature),
        torch.full((n,), params.top_k if params.top_k > 0 else V),
        torch.full((n,), params.top_p),
        min_p=torch.full((n,), params.min_p),
    )
    for i, (a, b) in enumerate(hist):
        torch.testing.assert_close(got[i], _hf_chain(logits[i], a + b, params), rtol=1e-5, atol=1e-6)


def test_plain_sampler_draws_from_the_processed_distribution():
    """sample() after apply_logits_processors follows the softmax of transformers' chain (temperature,
    top-k, top-p, min-p after the repetition penalty): a histogram over many seeds."""
    params = SamplingParams(temperature=0.9, repetition_penalty=1.6, top_k=20, top_p=0.95, min_p=0.03)
    g = torch.Generator().manual_seed(4)
    logits_row = torch.randn(V, generator=g)
    prompt, out = [0, 1, 2, 3], [int(logits_row.argmax()), 4]
    n = 20000
    reqs = [_request(params, prompt, out, seed=s) for s in range(n)]
    x = _processed(logits_row.expand(n, V).contiguous(), reqs)
    st = SamplingTensors.build(
        [params.temperature] * n,
        [params.top_k] * n,
        [params.top_p] * n,
        list(range(n)),
        [9] * n,
        V,
        "cpu",
        min_p=[params.min_p] * n,
    )
    hist = torch.bincount(sample(x, st), minlength=V).double() / n
    ref = _hf_chain(logits_row, prompt + out, params).double()
    assert (hist[ref == 0] == 0).all()
    assert (hist - ref).abs().max() < 0.015


def test_greedy_takes_the_processed_argmax():
    """A greedy row takes the argmax after the processors (here a penalty demotes the raw argmax)."""
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 8] = 5.0, 4.0
    req = _request(SamplingParams(temperature=0.0, repetition_penalty=2.0), [7], [])
    st = SamplingTensors.build([0.0], [-1], [1.0], [0], [1], V, "cpu")
    assert sample(_processed(logits, [req]), st).item() == 8


def test_no_processor_means_no_work():
    """With no row using a processor the builder returns None and the logits pass through unchanged."""
    reqs = [_request(SamplingParams(temperature=0.7, min_p=0.1), [1], [2])]
    assert build_logits_processors(reqs, V, torch.device("cpu")) is None
    logits = torch.randn(1, V)
    assert apply_logits_processors(logits, None) is logits
