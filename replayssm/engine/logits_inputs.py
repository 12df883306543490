"""Host side of the logits processors: each logit row's request and token history ->
`LogitsProcessorTensors` (ops/sampling.py), in one host-to-device copy.

A logit row predicts the token after its request's history. The history is what the host knows
(prompt + output_token_ids), then `extra` tokens the host knows but the request has not appended
yet (a verify row's drafts before its position), then at most one token still on the device (`fed`:
the previous step's sample, for a step launched before that sample was read back):

    row k:  prompt | output_token_ids | extra[k] | fed token (device)  -> predicts the next token
            `------ seen (repetition) ----------------------------------'
                     `------ output counts (presence, frequency) -------'

Rows of requests that use no processor are left out (`LogitsProcessorTensors.rows`); with none in
the batch `build_logits_processors` returns None after one pass over the rows' flags.
"""

from __future__ import annotations

import torch

from replayssm.engine.host_pack import HostPack
from replayssm.engine.request import Request
from replayssm.ops.sampling import LogitsProcessorTensors


def build_logits_processors(requests: list[Request], vocab_size: int, device: torch.device, *,
                            extra: list[list[int]] | None = None,
                            fed: tuple[torch.Tensor, list[int | None]] | None = None,
                            ) -> LogitsProcessorTensors | None:
    """requests[k]: the request of logit row k (a request may own several rows: verify).
    extra[k]: host tokens after its output_token_ids (None: none). fed: (device tokens, per row the
    index of its last history token in them, or None). None when no row uses a processor."""
    rows = [k for k, r in enumerate(requests) if r.processed]
    if not rows:
        return None
    m = len(rows)
    params = [requests[k].params for k in rows]
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    use_freq = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    history = use_rep or use_freq
    fed_rows = [(i, fed[1][k]) for i, k in enumerate(rows) if fed is not None and fed[1][k] is not None]
    i64, f32 = torch.int64, torch.float32
    pack = HostPack()
    parts: dict[str, int] = {}
    if history:
        # Each penalized request's host history is scattered once, into its first row's owner slot.
        owner: dict[int, int] = {}
        owner_of = []
        prompt_u, prompt_t, out_u, out_t, extra_r, extra_t = [], [], [], [], [], []
        for i, k in enumerate(rows):
            r = requests[k]
            if not r.params.penalized:
                owner_of.append(-1)
                continue
            u = owner.get(id(r))
            if u is None:
                u = owner[id(r)] = len(owner)
                if use_rep and r.params.repetition_penalty != 1.0:
                    prompt_u.extend([u] * r.num_prompt_tokens)
                    prompt_t.extend(r.prompt_token_ids)
                out_u.extend([u] * len(r.output_token_ids))
                out_t.extend(r.output_token_ids)
            owner_of.append(u)
            if extra is not None and extra[k]:
                extra_r.extend([i] * len(extra[k]))
                extra_t.extend(extra[k])
        num_owners = len(owner)
        parts.update(owner=pack.add([max(u, 0) for u in owner_of], i64),
                     has_history=pack.add([u >= 0 for u in owner_of], torch.bool),
                     out_u=pack.add(out_u, i64), out_t=pack.add(out_t, i64),
                     extra_r=pack.add(extra_r, i64), extra_t=pack.add(extra_t, i64))
        if use_rep:
            parts.update(prompt_u=pack.add(prompt_u, i64), prompt_t=pack.add(prompt_t, i64),
                         rep=pack.add([float(p.repetition_penalty) for p in params], f32, (m, 1)))
        if use_freq:
            parts.update(freq=pack.add([float(p.frequency_penalty) for p in params], f32, (m, 1)),
                         pres=pack.add([float(p.presence_penalty) for p in params], f32, (m, 1)))
        if fed_rows:
            parts.update(fed_r=pack.add([i for i, _ in fed_rows], i64),
                         fed_i=pack.add([j for _, j in fed_rows], i64))
    bias_r, bias_t, bias_v, ban_r, ban_t = [], [], [], [], []
    for i, k in enumerate(rows):
        r = requests[k]
        p = r.params
        if p.logit_bias is not None:
            bias_r.extend([i] * len(p.logit_bias))
            bias_t.extend(p.logit_bias)
            bias_v.extend(p.logit_bias.values())
        if p.min_tokens:
            generated = len(r.output_token_ids) + (len(extra[k]) if extra is not None else 0) + \
                (fed is not None and fed[1][k] is not None)
            if generated < p.min_tokens:
                ban_r.extend([i] * len(r.min_tokens_stop_ids))
                ban_t.extend(r.min_tokens_stop_ids)
    if bias_r:
        parts.update(bias_r=pack.add(bias_r, i64), bias_t=pack.add(bias_t, i64), bias_v=pack.add(bias_v, f32))
    if ban_r:
        parts.update(ban_r=pack.add(ban_r, i64), ban_t=pack.add(ban_t, i64))
    all_rows = m == len(requests)
    if not all_rows:
        parts["rows"] = pack.add(rows, i64)
    sent = pack.send(device)
    t = {name: sent[i] for name, i in parts.items()}
    proc = LogitsProcessorTensors(rows=None if all_rows else t["rows"])
    if history:
        base = torch.zeros(num_owners, vocab_size, dtype=f32, device=device)
        base.index_put_((t["out_u"], t["out_t"]), torch.ones_like(t["out_t"], dtype=f32), accumulate=True)
        counts = base[t["owner"]] * t["has_history"][:, None]
        counts.index_put_((t["extra_r"], t["extra_t"]), torch.ones_like(t["extra_t"], dtype=f32),
                          accumulate=True)
        if fed_rows:
            counts.index_put_((t["fed_r"], fed[0][t["fed_i"]]), torch.ones_like(t["fed_r"], dtype=f32),
                              accumulate=True)
        if use_freq:
            proc.frequency_penalty, proc.presence_penalty, proc.output_counts = t["freq"], t["pres"], counts
        if use_rep:
            prompt = torch.zeros(num_owners, vocab_size, dtype=torch.bool, device=device)
            seen = torch.ones_like(t["prompt_t"], dtype=torch.bool)
            prompt.index_put_((t["prompt_u"], t["prompt_t"]), seen)
            proc.repetition_penalty = t["rep"]
            proc.seen = (prompt[t["owner"]] & t["has_history"][:, None]) | (counts > 0)
    if bias_r:
        proc.bias = (t["bias_r"], t["bias_t"], t["bias_v"])
    if ban_r:
        proc.banned = (t["ban_r"], t["ban_t"])
    return proc
