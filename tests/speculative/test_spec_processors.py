"""Speculative verify with logits processors: each verify position is processed with its own history
(the drafts before it counted), greedy takes the processed argmax, and sampling draws from the
processed distribution."""

import pytest
import torch
from spec_helpers import generate, make_llm, one_thread  # noqa: F401 (autouse fixture)
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from replayssm import SamplingParams
from replayssm.engine.request import Request
from replayssm.speculative.decode import SpecDecoder
from replayssm.speculative.proposer import Drafts
from replayssm.speculative.stats import SpecStats

V = 12


def _decoder(k: int) -> SpecDecoder:
    dec = SpecDecoder.__new__(SpecDecoder)
    dec.stats = SpecStats(k, "ngram", True)
    return dec


def _reference(logits_j: torch.Tensor, seq: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([seq]), logits_j.double()[None])[
        0
    ]
    count = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=V).double()
    return x - p.frequency_penalty * count


def test_greedy_verify_takes_the_processed_argmax_per_position():
    """Greedy verify emits what sequential greedy decoding of the processed logits emits, drafts before a
    position counting as output there."""
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=1.0)
    K, b = 3, 64
    logits = torch.randn(b * (K + 1), V, generator=g) * 2
    reqs, drafts = [], []
    for i in range(b):
        r = Request(f"r{i}", [1, 2], p, seed=i, arrival=i)
        r.output_token_ids.extend(torch.randint(0, V, (3,), generator=g).tolist())
        reqs.append(r)
        # Drafts: the raw argmax (which the penalties may reject) or a random token.
        raw = logits[i * (K + 1) : i * (K + 1) + K].argmax(-1).tolist()
        drafts.append(
            Drafts(
                [
                    t if torch.rand((), generator=g) < 0.7 else int(torch.randint(0, V, (), generator=g))
                    for t in raw
                ]
            )
        )
    emitted, _, _ = _decoder(K).verify(logits, [i * (K + 1) for i in range(b)], reqs, drafts)
    num_rejected = 0
    for i, (r, d) in enumerate(zip(reqs, drafts)):
        want, seq, out = [], r.prompt_token_ids + r.output_token_ids, list(r.output_token_ids)
        for j in range(K + 1):
            tok = int(_reference(logits[i * (K + 1) + j], seq, out, p).argmax())
            want.append(tok)
            seq, out = seq + [tok], out + [tok]
            if j == K or tok != d.tokens[j]:
                num_rejected += j < K
                break
        assert emitted[i] == want, i
    assert num_rejected > 0


def test_random_verify_draws_from_the_processed_distribution():
    """With drafts, the first emitted token follows softmax(processed logits / T): a histogram over seeds."""
    g = torch.Generator().manual_seed(1)
    p = SamplingParams(temperature=0.8, repetition_penalty=1.7, frequency_penalty=0.6)
    K, n = 2, 6000
    row = torch.randn(K + 1, V, generator=g)
    logits = row.repeat(n, 1)
    draft = [int(row[0].argmax()), 3]
    history = [4, int(row[0].argmax())]
    reqs = []
    for s in range(n):
        r = Request(f"r{s}", [1], p, seed=s, arrival=s)
        r.output_token_ids.extend(history)
        reqs.append(r)
    emitted, _, _ = _decoder(K).verify(logits, [s * (K + 1) for s in range(n)], reqs, [Drafts(draft)] * n)
    hist = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=V).double() / n
    want = (_reference(row[0], [1] + history, history, p) / p.temperature).softmax(-1)
    assert (hist - want).abs().max() < 0.025


@pytest.mark.parametrize("replayssm", [True, False])
def test_greedy_spec_with_processors_equals_plain(replayssm):
    """ngram speculation with penalties, logit_bias and min_tokens gives plain decoding's tokens."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        logit_bias={7: 1.5},
        min_tokens=4,
    )
    plain = generate(make_llm(), params)
    llm = make_llm(replayssm=replayssm, replay_window=8, num_speculative_tokens=3, speculative_method="ngram")
    assert generate(llm, params) == plain
    assert llm.get_metrics()["spec_verify_steps"] > 0
