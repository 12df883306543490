"""Rejection sampling (replayssm.speculative.verify): greedy matching and losslessness on a small
vocabulary."""

import torch

from replayssm.speculative.verify import rejection_sample, target_probs

V = 6


def _params(b, temperature=1.0):
    return (
        torch.full((b,), temperature),
        torch.full((b,), V, dtype=torch.int64),
        torch.ones(b),
        torch.arange(b, dtype=torch.int64) * 7919 + 11,
        torch.full((b,), 40, dtype=torch.int64),
    )


def _draw(probs, gen):
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def test_greedy_accepts_exactly_the_argmax_prefix():
    """Temperature 0: drafts are accepted while they equal the argmax; the next token is the argmax."""
    g = torch.Generator().manual_seed(0)
    b, K = 64, 3
    logits = torch.randn(b, K + 1, V, generator=g)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :K].clone()
    cut = torch.randint(0, K + 1, (b,), generator=g)
    for i in range(b):
        if cut[i] < K:
            drafts[i, cut[i]] = (argmax[i, cut[i]] + 1) % V
    num = torch.randint(0, K + 1, (b,), generator=g)
    tokens, acc = rejection_sample(logits, drafts, num, None, *_params(b, 0.0))
    for i in range(b):
        m = min(int(cut[i]), int(num[i]))
        assert int(acc[i]) == m + 1
        assert tokens[i, : m + 1].tolist() == argmax[i, : m + 1].tolist()


def _first_token_histogram(K, model_drafts, b=40000):
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(K + 1, V, generator=g) * 1.5
    draft_logits = torch.randn(K, V, generator=g) * 1.5
    logits = target_logits.expand(b, K + 1, V).contiguous()
    q = draft_logits.softmax(-1)
    if model_drafts:
        drafts = torch.stack([_draw(q[j].expand(b, V), g) for j in range(K)], dim=-1)
        draft_probs = q.expand(b, K, V).contiguous()
    else:
        drafts = torch.stack([torch.full((b,), j % V) for j in range(K)], dim=-1)
        draft_probs = None
    tokens, acc = rejection_sample(logits, drafts, torch.full((b,), K), draft_probs, *_params(b))
    p = target_probs(target_logits, torch.ones(K + 1), torch.full((K + 1,), V), torch.ones(K + 1))
    first = torch.bincount(tokens[:, 0], minlength=V).float() / b
    # Second emitted token given the first was an accepted draft equal to token x: must be p_1.
    x = int(drafts[0, 0]) if not model_drafts else int(q[0].argmax())
    sel = (tokens[:, 0] == x) & (acc >= 2) if K else None
    return p, first, tokens, acc, sel


def test_rejection_sampling_preserves_the_target_distribution():
    """Seeded: with model drafts (q) and deterministic drafts, the first emitted token follows p_0."""
    for model_drafts in (True, False):
        p, first, tokens, acc, _ = _first_token_histogram(3, model_drafts)
        assert (first - p[0]).abs().max() < 0.012, (model_drafts, first, p[0])
        assert acc.min() >= 1 and acc.max() <= 4


def test_second_token_after_an_accepted_draft_follows_p1():
    """Seeded: conditioned on an accepted first draft, the second emitted token follows p_1."""
    p, _, tokens, acc, sel = _first_token_histogram(2, model_drafts=True)
    second = torch.bincount(tokens[sel, 1], minlength=V).float() / int(sel.sum())
    assert int(sel.sum()) > 2000
    assert (second - p[1]).abs().max() < 0.03, (second, p[1])


def test_forced_rows_accept_the_forced_count():
    """A forced row (synthetic drafter) accepts exactly the forced number of drafts."""
    b, K = 8, 3
    logits = torch.randn(b, K + 1, V)
    drafts = torch.randint(0, V, (b, K))
    forced = torch.tensor([0, 1, 2, 3, -1, 3, 2, 0])
    tokens, acc = rejection_sample(logits, drafts, torch.full((b,), K), None, *_params(b, 0.0), forced=forced)
    for i in range(b):
        if forced[i] >= 0:
            assert int(acc[i]) == int(forced[i]) + 1
            assert tokens[i, : int(forced[i])].tolist() == drafts[i, : int(forced[i])].tolist()
            assert int(tokens[i, int(forced[i])]) == int(logits[i, int(forced[i])].argmax())


def test_draws_do_not_depend_on_the_batch():
    """A row's verify result depends only on its own seed and position, not on its neighbours."""
    b, K = 16, 3
    logits = torch.randn(b, K + 1, V)
    drafts = torch.randint(0, V, (b, K))
    num = torch.full((b,), K)
    full = rejection_sample(logits, drafts, num, None, *_params(b))
    perm = torch.randperm(b)
    params = [t[perm] for t in _params(b)]
    part = rejection_sample(logits[perm], drafts[perm], num, None, *params)
    assert torch.equal(full[0][perm], part[0]) and torch.equal(full[1][perm], part[1])


def test_all_greedy_fast_path_equals_the_full_path(monkeypatch):
    """all_greedy=True gives the full path's tokens and counts (forced rows too) without any softmax."""
    import replayssm.speculative.verify as verify

    g = torch.Generator().manual_seed(3)
    b, K = 32, 4
    logits = torch.randn(b, K + 1, V, generator=g)
    drafts = torch.where(torch.rand(b, K, generator=g) < 0.6, logits[:, :K].argmax(-1),
                         torch.randint(0, V, (b, K), generator=g))
    num = torch.randint(0, K + 1, (b,), generator=g)
    forced = torch.randint(-1, K + 1, (b,), generator=g).minimum(num)

    def no_softmax(*args, **kwargs):
        raise AssertionError("the greedy path computed target probabilities")

    for f in (None, forced):
        want = rejection_sample(logits, drafts, num, None, *_params(b, 0.0), forced=f)
        with monkeypatch.context() as m:
            m.setattr(verify, "target_probs", no_softmax)
            got = rejection_sample(logits, drafts, num, None, *_params(b, 0.0), forced=f, all_greedy=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_host_known_truncation_flags_read_nothing_from_the_tensors():
    """target_probs with any_top_k / any_top_p given never inspects top_k / top_p (no device read)."""
    logits = torch.randn(5, V)
    want = target_probs(logits, torch.ones(5), torch.full((5,), V), torch.ones(5))
    got = target_probs(logits, torch.ones(5), None, None, any_top_k=False, any_top_p=False)
    assert torch.allclose(got, want)
    k = torch.full((5,), 2)
    assert torch.equal(target_probs(logits, torch.ones(5), k, torch.ones(5), any_top_k=True, any_top_p=False),
                       target_probs(logits, torch.ones(5), k, torch.ones(5)))


def test_spec_decoder_passes_host_flags(monkeypatch):
    """SpecDecoder.verify tells rejection_sample what the host knows: all greedy, no top-k / top-p."""
    from types import SimpleNamespace

    import replayssm.speculative.decode as decode
    from replayssm.sampling_params import SamplingParams
    from replayssm.speculative.proposer import Drafts

    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return rejection_sample(*args, **kwargs)

    monkeypatch.setattr(decode, "rejection_sample", spy)
    dec = decode.SpecDecoder.__new__(decode.SpecDecoder)
    dec.stats = SimpleNamespace(record=lambda *a: None)
    logits = torch.randn(7, V)
    for params, greedy in ((SamplingParams(temperature=0.0), True), (SamplingParams(temperature=0.7), False)):
        reqs = [SimpleNamespace(params=params, seed=11 + i, num_tokens=9, processed=False, grammar=None)
                for i in range(2)]
        emitted, _, _ = dec.verify(logits, [0, 4], reqs, [Drafts([1, 2, 3]), Drafts([4, 5])])
        assert seen["all_greedy"] is greedy and seen["any_top_k"] is False and seen["any_top_p"] is False
        assert 1 <= len(emitted[0]) <= 4 and 1 <= len(emitted[1]) <= 3
