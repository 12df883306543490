import pytest
import torch

from replayssm.ops.sampling import SamplingTensors, apply_top_k_top_p, sample, token_logprobs, uniform_noise

V = 50


def _params(b, temperature=1.0, top_k=-1, top_p=1.0, seeds=None, positions=None):
    as_list = lambda v: v if isinstance(v, list) else [v] * b  # noqa: E731
    return SamplingTensors.build(
        temperature=as_list(temperature),
        top_k=as_list(top_k),
        top_p=as_list(top_p),
        seeds=seeds if seeds is not None else list(range(b)),
        positions=positions if positions is not None else [7] * b,
        vocab_size=V,
        device="cpu",
    )


def test_greedy_is_argmax_with_logprobs():
    """temperature 0 takes the argmax, and the logprob is log_softmax of the raw logits at it."""
    logits = torch.randn(6, V)
    tokens = sample(logits, _params(6, temperature=0.0))
    lp, _ = token_logprobs(logits, tokens)
    assert torch.equal(tokens, logits.argmax(-1))
    ref = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref)


def test_mixed_rows_greedy_and_random():
    """Mixing greedy and random rows: greedy rows take the argmax, random rows draw as they would alone."""
    logits = torch.randn(4, V)
    temps = [0.0, 1.0, 0.0, 2.0]
    tokens = sample(logits, _params(4, temperature=temps, top_k=[-1, 10, -1, 20], seeds=[1, 2, 3, 4]))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    for i in (1, 3):
        alone = sample(
            logits[i : i + 1], _params(1, temperature=temps[i], top_k=[10, 20][i // 2], seeds=[i + 1])
        )
        assert alone[0] == tokens[i]


def test_top_k_top_p_masks():
    """top-k keeps the k largest; top-p the smallest prefix reaching p; the top token always survives."""
    logits = torch.log(
        torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]])
    )
    out = apply_top_k_top_p(logits, torch.tensor([2, 4, 4]), torch.tensor([1.0, 0.7, 0.5]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [
        [True, True, False, False],
        [True, True, False, False],
        [True, False, False, False],
    ]
    assert torch.equal(out[kept], logits[kept])


def test_sampled_tokens_stay_inside_top_k_top_p_sets():
    """Across many seeds, sampled tokens only come from the set that survives on logits / T."""
    logits = torch.randn(1, V).repeat(200, 1)
    p = _params(200, temperature=1.5, top_k=5, top_p=0.9, seeds=list(range(200)))
    tokens = sample(logits, p)
    allowed = torch.isfinite(apply_top_k_top_p(logits[:1] / 1.5, torch.tensor([5]), torch.tensor([0.9])))[0]
    assert allowed[tokens].all()
    assert len(set(tokens.tolist())) > 1


def test_seeded_reproducible_and_batch_independent():
    """A row's draw depends only on (seed, position, logits): same in any batch and any row order."""
    logits = torch.randn(5, V)
    seeds, pos = [11, 12, 13, 14, 15], [3, 9, 9, 0, 100]
    a = sample(logits, _params(5, seeds=seeds, positions=pos))
    perm = [4, 2, 0, 3, 1]
    b = sample(logits[perm], _params(5, seeds=[seeds[i] for i in perm], positions=[pos[i] for i in perm]))
    assert torch.equal(a[perm], b)
    single = sample(logits[2:3], _params(1, seeds=[13], positions=[9]))
    assert single[0] == a[2]


def test_sampling_follows_the_distribution():
    """Empirical frequencies over positions match softmax(logits / T) (counter-based noise is unbiased)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    p = SamplingTensors.build(
        [0.7] * 4000, [-1] * 4000, [1.0] * 4000, [5] * 4000, list(range(4000)), 4, "cpu"
    )
    tokens = sample(logits, p)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    torch.testing.assert_close(freq, (logits[0] / 0.7).softmax(-1), atol=0.03, rtol=0)


def test_uniform_noise_range_and_variety():
    """Noise lies in (0, 1), differs across seeds and positions, and has mean about 1/2."""
    u = uniform_noise(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), 1000)
    assert (u > 0).all() and (u < 1).all()
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(u.mean().item() - 0.5) < 0.03


@pytest.mark.parametrize("seed", [-1, 2**63 - 1, 2**70])
def test_extreme_seeds(seed):
    """Negative and huge seeds are reduced into int64 and still sample."""
    tokens = sample(torch.randn(1, V), _params(1, seeds=[seed]))
    assert 0 <= tokens.item() < V
