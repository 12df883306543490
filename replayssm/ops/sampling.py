"""Batched token sampling with per-row parameters and counter-based randomness.

A row's logits go through `apply_logits_processors` (penalties, logit_bias, the min_tokens mask:
they change the argmax, so greedy rows take them too), then `sample` (greedy argmax, or
temperature, top-k, top-p, min-p and a draw). Rows that use no processor are not touched, and a
batch where none does skips the processing entirely (no allocation, no kernel).

Random rows use the Gumbel-max trick with noise that is a pure function of
(seed, position, token id): a row's draw never depends on which other rows share the batch,
on chunking, or on preemption and recompute, so a seeded request is reproducible anywhere.
Nothing here reads a device value back; callers sync once when they read the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(v: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding values in [0, 2^32)."""
    v = v ^ (v >> 16)
    v = (v * 0x7FEB352D) & _MASK32  # int64 products wrap, but their low 32 bits are exact
    v = v ^ (v >> 15)
    v = (v * 0x846CA68B) & _MASK32
    return v ^ (v >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1), shape (b, vocab_size): element (i, t) depends only on
    (seeds[i], positions[i], t). seeds, positions: (b,) int64."""
    key = _mix32(seeds & _MASK32)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (positions & _MASK32))
    idx = _mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) + 0x632BE5AB)
    v = _mix32(key[:, None] ^ idx[None, :])
    return ((v >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """Sampling parameters of the random (temperature > 0) rows, on the logits' device.

    random_rows: (r,) int64 indices of those rows in the batch, or None when every row is
    random; greedy rows need no parameters. temperature (r,) fp32; top_k (r,) int64
    (vocab size = off); top_p (r,) fp32; min_p (r,) fp32 or None when no row uses it; seeds,
    positions (r,) int64 (position = index of the token being sampled). All None when every row
    is greedy.
    """

    random_rows: torch.Tensor | None
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    seeds: torch.Tensor | None
    positions: torch.Tensor | None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    min_p: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        seeds: list[int],
        positions: list[int],
        vocab_size: int,
        device: torch.device | str,
        greedy_eps: float = 1e-5,
        min_p: list[float] | None = None,
    ) -> SamplingTensors:
        """From host lists (one host-to-device copy each). top_k <= 0 or >= vocab means off;
        min_p None or 0 means off."""
        rows = [i for i, t in enumerate(temperature) if t >= greedy_eps]
        if not rows:
            return cls(None, None, None, None, None, None, all_greedy=True, any_top_k=False, any_top_p=False)
        ks = [vocab_size if top_k[i] <= 0 or top_k[i] >= vocab_size else top_k[i] for i in rows]
        ps = [float(top_p[i]) for i in rows]
        # Seeds are reduced into int64 range; the hash only uses their 64 bits.
        seeds64 = [((seeds[i] + (1 << 63)) % (1 << 64)) - (1 << 63) for i in rows]
        mps = [float(min_p[i]) for i in rows] if min_p is not None else []
        pin = torch.device(device).type == "cuda"

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            # Pinned staging lets the copy run asynchronously behind the forward pass.
            t = torch.tensor(values, dtype=dtype)
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        return cls(
            random_rows=None if len(rows) == len(temperature) else dev(rows, torch.int64),
            temperature=dev([float(temperature[i]) for i in rows], torch.float32),
            top_k=dev(ks, torch.int64),
            top_p=dev(ps, torch.float32),
            seeds=dev(seeds64, torch.int64),
            positions=dev([positions[i] for i in rows], torch.int64),
            all_greedy=False,
            any_top_k=any(k < vocab_size for k in ks),
            any_top_p=any(p < 1.0 for p in ps),
            min_p=dev(mps, torch.float32) if any(m > 0.0 for m in mps) else None,
        )


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf. logits (b, V); top_k (b,) int64
    (V = off); top_p (b,) fp32 (1 = off). The most likely token always survives."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= rank >= top_k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Drop a token once the tokens ranked above it already reach top_p.
        drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set logits whose probability is below min_p times the row's largest to -inf (transformers'
    MinPLogitsWarper). logits (b, V), already temperature-scaled; min_p (b,) fp32 (0 = off)."""
    probs = logits.softmax(dim=-1)
    drop = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(drop, float("-inf"))


@dataclass
class LogitsProcessorTensors:
    """The logits processors of one batch of logit rows, on the logits' device
    (built by engine/logits_inputs.py; m = number of processed rows).

    rows: (m,) int64 logit rows that use a processor (None: every row).
    repetition_penalty (m, 1) fp32 with seen (m, V) bool: tokens of the prompt or the output so far.
    frequency_penalty, presence_penalty (m, 1) fp32 with output_counts (m, V) fp32: each token's
        occurrences in the output so far.
    bias: (row, token, value) flat (n,) tensors: logit_bias entries (row indexes the m rows).
    banned: (row, token) flat (n,) tensors: tokens set to -inf (min_tokens).
    A field is None when no row uses it.
    """

    rows: torch.Tensor | None
    repetition_penalty: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None


def apply_logits_processors(logits: torch.Tensor, proc: LogitsProcessorTensors | None) -> torch.Tensor:
    """The logits the sampler draws from: logits (n, V) fp32 with, per processed row, the repetition
    penalty (transformers' RepetitionPenaltyLogitsProcessor), frequency and presence penalties
    (OpenAI's definition), logit_bias, then the min_tokens mask, in that order. Returns `logits`
    itself when proc is None; never writes into it (logprobs read the unmodified logits)."""
    if proc is None:
        return logits
    x = logits.clone() if proc.rows is None else logits[proc.rows]
    if proc.repetition_penalty is not None:
        rp = proc.repetition_penalty
        x = torch.where(proc.seen, torch.where(x < 0, x * rp, x / rp), x)
    if proc.frequency_penalty is not None:
        counts = proc.output_counts
        x = x - proc.frequency_penalty * counts - proc.presence_penalty * (counts > 0).to(x.dtype)
    if proc.bias is not None:
        r, t, v = proc.bias
        x = x.index_put((r, t), v, accumulate=True)
    if proc.banned is not None:
        x = x.index_put(proc.banned, x.new_full((1,), float("-inf")))
    return x if proc.rows is None else logits.index_copy(0, proc.rows, x)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int = 0
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Under the unmodified model distribution (log_softmax of the raw logits (..., V), computed
    once): the logprobs of `tokens` (...), and for n > 0 the n most likely tokens' (ids, logprobs)
    (..., n), most likely first (else None)."""
    full = logits.log_softmax(dim=-1, dtype=torch.float32)
    chosen = full.gather(-1, tokens[..., None]).squeeze(-1)
    if not n:
        return chosen, None
    values, ids = full.topk(n, dim=-1)
    return chosen, (ids, values)


def top_pairs(ids: list[list[int]], values: list[list[float]]) -> list[list[tuple[int, float]]]:
    """`token_logprobs`' alternatives of each row, read back as lists, as (id, logprob) pairs."""
    return [list(zip(i, v)) for i, v in zip(ids, values)]


def sample(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Sample one token per row: logits (b, V) fp32, after `apply_logits_processors` -> token ids (b,)
    int64 (their logprobs under the unmodified model distribution: `token_logprobs`)."""
    tokens = logits.argmax(dim=-1)
    if not params.all_greedy:
        rows = params.random_rows
        # Only random rows pay for scaling, masking and the (rows, vocab) noise.
        scaled = (logits if rows is None else logits[rows]) / params.temperature[:, None]
        if params.any_top_k or params.any_top_p:
            scaled = apply_top_k_top_p(
                scaled, params.top_k if params.any_top_k else None, params.top_p if params.any_top_p else None
            )
        if params.min_p is not None:
            scaled = apply_min_p(scaled, params.min_p)
        u = uniform_noise(params.seeds, params.positions, logits.shape[-1])
        sampled = (scaled - torch.log(-torch.log(u))).argmax(dim=-1)  # Gumbel-max
        tokens = sampled if rows is None else tokens.index_copy(0, rows, sampled)
    return tokens
