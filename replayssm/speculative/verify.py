"""Verify k drafted tokens against the target's 1 + k logits: greedy match or lossless rejection sampling.

One verify row holds the logits of positions c .. c+k (logit j predicts the token at sequence
index ``position + j``) and the drafts d_1 .. d_k:

    greedy (temperature 0): accept d_j while d_j == argmax(logits_{j-1}); the next token is the
        argmax at the first mismatch (or the bonus argmax at k): exactly plain greedy decoding.
    random: p_j = target distribution (temperature, top-k, top-p, min-p), q_j = draft distribution
        (one-hot for deterministic drafters). Accept d_j with probability min(1, p(d_j)/q(d_j));
        at the first rejection m sample from normalize(max(0, p_m - q_m)); on full acceptance
        sample the bonus token from p_k. The emitted tokens are distributed exactly as plain
        sampling from p (Leviathan et al. / Chen et al. speculative sampling).

The logits come in processed (`apply_logits_processors`: penalties, logit_bias, min_tokens, each
verify position with its own history, drafts before it included), so greedy takes the processed
argmax and p is the processed distribution, as plain decoding would draw from.

All random draws are counter-based: a pure function of (request seed, sequence index), so the
result never depends on which other requests share the batch.
"""

from __future__ import annotations

import torch

from replayssm.ops.sampling import apply_min_p, apply_top_k_top_p, uniform_noise
from replayssm.sampling_params import GREEDY_EPS

# Seed salts: the acceptance coin and the draft draw must be independent of the Gumbel noise
# that the plain sampler (and our residual / bonus draw) uses for the same position.
ACCEPT_SALT = 0x5EED_A11C_E5
DRAFT_SALT = 0x0D2A_F7ED_51


def salted(seeds: torch.Tensor, salt: int) -> torch.Tensor:
    """A second independent stream per request: seeds (b,) int64 xor a constant."""
    return seeds ^ salt


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, *, any_top_k: bool | None = None,
                 any_top_p: bool | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Sampling distribution per row. logits (n, V) fp32; temperature, top_p (n,) fp32 (> 0);
    top_k (n,) int64 (V = off); min_p (n,) fp32 or None (off for every row). any_top_k / any_top_p:
    whether some row truncates, when the caller knows it on the host (None: read from the device,
    a host sync). Returns probs (n, V) fp32."""
    scaled = logits / temperature[:, None]
    V = logits.shape[-1]
    use_k = bool((top_k < V).any()) if any_top_k is None else any_top_k
    use_p = bool((top_p < 1.0).any()) if any_top_p is None else any_top_p
    if use_k or use_p:
        scaled = apply_top_k_top_p(scaled, top_k if use_k else None, top_p if use_p else None)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    return scaled.softmax(dim=-1)


def gumbel_pick(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One draw per row from probs (n, V) (need not sum to 1), keyed by (seeds, positions) (n,)."""
    u = uniform_noise(seeds, positions, probs.shape[-1])
    return (probs.clamp_min(0).log() - torch.log(-torch.log(u))).argmax(dim=-1)


def rejection_sample(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    forced: torch.Tensor | None = None,
    *,
    all_greedy: bool = False,
    any_top_k: bool | None = None,
    any_top_p: bool | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify padded draft rows.

    logits (b, K+1, V) fp32: row i's positions j <= num_drafts[i] are real; drafts (b, K) int64
    (entries past num_drafts ignored); num_drafts (b,) int64 in [0, K]; draft_probs (b, K, V) or
    None (drafts are deterministic: q = one-hot); temperature, top_p (b,) fp32; top_k (b,) int64
    (V = off); seeds (b,) int64; positions (b,) int64: sequence index of the token logit 0 predicts;
    min_p (b,) fp32 or None (off for every row).
    forced (b,) int64 or None: rows with forced[i] >= 0 accept exactly that many drafts whatever
    the target says (synthetic benchmarks only; their output is not the model's).

    all_greedy: the caller knows every row is greedy: the same tokens from the argmax alone,
    without a softmax over the vocabulary. any_top_k / any_top_p: see target_probs.

    Returns (tokens (b, K+1) int64, num_accepted (b,) int64 in [1, num_drafts + 1]): row i emits
    tokens[i, :num_accepted[i]] (accepted drafts, then the corrected or bonus token).
    """
    b, K1, V = logits.shape
    K = K1 - 1
    dev = logits.device
    j = torch.arange(K1, device=dev)
    argmax = logits.argmax(dim=-1)  # (b, K+1)
    if all_greedy:
        return _greedy_verify(argmax, drafts.clamp(0, V - 1), num_drafts, forced)
    greedy = temperature < GREEDY_EPS
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = target_probs(logits.reshape(b * K1, V), safe_t.repeat_interleave(K1),
                         top_k.repeat_interleave(K1), top_p.repeat_interleave(K1), any_top_k=any_top_k,
                         any_top_p=any_top_p,
                         min_p=None if min_p is None else min_p.repeat_interleave(K1)).reshape(b, K1, V)
    d = drafts.clamp(0, V - 1)
    p_d = probs[:, :K].gather(-1, d[..., None]).squeeze(-1)  # (b, K)
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(-1, d[..., None]).squeeze(-1)
    pos = positions[:, None] + j[None, :]  # (b, K+1) sequence index of each predicted token
    coin = uniform_noise(salted(seeds, ACCEPT_SALT)[:, None].expand(b, K).reshape(-1),
                         pos[:, :K].reshape(-1), 1).reshape(b, K)
    accept = torch.where(greedy[:, None], d == argmax[:, :K], coin * q_d < p_d)
    accept &= j[None, :K] < num_drafts[:, None]
    m = accept.long().cumprod(dim=-1).sum(dim=-1)  # accepted drafts (b,)
    rejected = m < num_drafts
    if forced is not None:
        # A forced row samples its next token from p itself, as plain decoding would.
        rejected &= forced < 0
        m = torch.where(forced >= 0, forced, m)
    # The corrected token at position m: residual max(0, p - q) (q = 0 at the bonus position).
    p_m = probs[torch.arange(b, device=dev), m]  # (b, V)
    last = m.clamp(max=max(K - 1, 0))  # q at the bonus position is 0 (masked by `rejected`)
    if not K:
        q_m = torch.zeros_like(p_m)
    elif draft_probs is None:
        q_m = torch.zeros_like(p_m).scatter(-1, d.gather(-1, last[:, None]), 1.0)
    else:
        q_m = draft_probs[torch.arange(b, device=dev), last]
    residual = torch.where(rejected[:, None], (p_m - q_m).clamp_min(0), p_m)
    # Rounding can empty the residual when p == q; p itself is then the exact distribution.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_m, residual)
    final = gumbel_pick(residual, seeds, positions + m)
    final = torch.where(greedy, argmax.gather(-1, m[:, None]).squeeze(-1), final)
    tokens = torch.cat([d, torch.zeros_like(d[:, :1])], dim=-1)
    tokens = tokens.scatter(-1, m[:, None], final[:, None])
    return tokens, m + 1


def _greedy_verify(argmax: torch.Tensor, d: torch.Tensor, num_drafts: torch.Tensor,
                   forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """rejection_sample for all-greedy rows: accept while the draft is the argmax, then the argmax."""
    K = d.shape[1]
    j = torch.arange(K, device=d.device)
    accept = (d == argmax[:, :K]) & (j[None, :] < num_drafts[:, None])
    m = accept.long().cumprod(dim=-1).sum(dim=-1)
    if forced is not None:
        m = torch.where(forced >= 0, forced, m)
    final = argmax.gather(-1, m[:, None])
    tokens = torch.cat([d, torch.zeros_like(d[:, :1])], dim=-1).scatter(-1, m[:, None], final)
    return tokens, m + 1
