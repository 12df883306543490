"""Gated DeltaNet ops: per-token recurrence, chunked WY/UT form, ReplaySSM decode, baseline decode.

Per value head (Hv heads; v-head h reads k/q head h // (Hv // Hk)), state S (Dk, Dv) and per token
q, k (Dk) raw, v (Dv), log decay g <= 0 and beta in (0, 1). Every op L2-normalizes q and k in fp32
(eps 1e-6 inside the root, as transformers and FLA do) and scales q by Dk^-1/2, then:

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

With Γ_t = Σ_{i<=t} g_i from a state S_0, the WY/UT form of L tokens solves one unit lower
triangular system (I + A) U = [beta v | beta exp(Γ) k], A_ij = beta_i (k_i.k_j) exp(Γ_i - Γ_j)
for j < i, and with v'_j = U_v - U_k S_0 (the delta e_j each token adds, below):

    o_t = exp(Γ_t) S_0^T q_t + Σ_{j<=t} (q_t.k_j) exp(Γ_t - Γ_j) v'_j
    S_L = exp(Γ_L) S_0 + Σ_j exp(Γ_L - Γ_j) k_j v'_jᵀ

ReplaySSM keeps the Mamba-2 cache contract (ops/replay.py): a checkpoint S_0 per slot and a ring
of (k raw, e, g) behind the same cursors ring_start / committed, so `replay_commit` moves them
unchanged. e_t = beta_t (v_t - a_t S_{t-1}^T k_t) (a_t = exp(g_t)) is the delta token t adds,
S_t = a_t S_{t-1} + k_t e_t^T: it depends only on the tokens before t, not on where the checkpoint
sits nor on later tokens, so it is computed once, in the step where its token is new, and stored in
fp32. With Γ the cumulative g from the checkpoint over the ring entries, then the new tokens:

    a_t S_{t-1}^T k_t = exp(Γ_t) S_0^T k_t + Σ_{i<t} exp(Γ_t - Γ_i) (k_i.k_t) e_i
    e_t = beta_t (v_t - that)                              new tokens only, in order
    o_t = exp(Γ_t) S_0^T q_t + Σ_{i<=t} exp(Γ_t - Γ_i) (k_i.q_t) e_i
    S after the first c entries = exp(Γ_{c-1}) S_0 + Σ_{i<c} exp(Γ_{c-1} - Γ_i) k_i e_i^T

A decode row of q tokens computes its new tokens' e, their outputs, appends (k, e, g), and
folds the history into S_0 iff h + q > W; materialize is the fold over n entries. History rows past
`committed` are zero (g = 0, k = e = 0: a no-op entry). Raw k is stored, so a replayed key normalizes
to the same fp32 key the baseline used. Verify appends every drafted token; the accepted ones the
cursor keeps are exact, since an e never depends on later tokens. beta is folded into e, so the ring
keeps no copy of it.

Bytes per decode row, layer and step (s: state element bytes, a: activation bytes; a ring entry
is E = Hk Dk a + 4 Hv Dv + 4 Hv (k, e fp32, g), read and appended alike):

    op                                    reads                  writes
    gdn_state_update (q = 1)              Hv Dk Dv s             Hv Dk Dv s
    gdn_state_update (verify, q tokens)   Hv Dk Dv s             q Hv Dk Dv s
    gdn_replay_forward                    Hv Dk Dv s + h E       q E
      + flush (h + q > W, 1 step in ~W)   -                      Hv Dk Dv s
    gdn_replay_materialize (n entries)    Hv Dk Dv s + n E       Hv Dk Dv s

On the Qwen3-Next-80B-A3B shape (Hk 16, Hv 32, Dk = Dv = 128, bf16 activations, fp32 state,
W = 16) a state is 2 MiB and E = 20.1 KiB: the baseline moves 4 MiB per decode step, ReplaySSM
at most 2 MiB + 322 KiB of history + 20 KiB appended, plus 2 MiB once in W steps (2.46 MiB).

The decode ops dispatch with `pick_impl`: Triton twins (`ops/triton/gdn.py`) for CUDA tensors, each at
the tile its table gives for (state dtype, more than one token per row) (`gdn_state.py: CONFIGS` for
the state update, `ops/triton/gdn.py: REPLAY_CONFIGS` for replay and materialize), the `*_ref`
functions here elsewhere.
"""

from __future__ import annotations

import torch

from replayssm.ops._checks import FLOAT_DTYPES, check_group_count, check_indices, check_int, check_tensor
from replayssm.ops.common import heads_from_groups, pick_impl, store_states
from replayssm.ops.replay import check_cursors
from replayssm.ops.rounding import resolve_seed

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + 1e-6) over the last dim, in x's dtype (zero stays zero)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _keys(t: torch.Tensor, num_v_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Raw (..., Hk, Dk) q or k -> L2-normalized (..., Hv, Dk) in `dtype`."""
    return heads_from_groups(l2norm(t.to(dtype)), num_v_heads)


def gdn_recurrence_ref(q, k, v, g, beta, state0, *, dtype: torch.dtype = torch.float32):
    """The per-token loop, one token at a time in `dtype` (float64 for the oracle).

    q, k (b, L, Hk, Dk) raw; v (b, L, Hv, Dv); g, beta (b, L, Hv); state0 (b, Hv, Dk, Dv).
    Returns (o (b, L, Hv, Dv), states after each token (b, L, Hv, Dk, Dv)), both in `dtype`.
    """
    Hv, Dk = v.shape[2], q.shape[-1]
    qs = _keys(q, Hv, dtype) * Dk**-0.5
    ks = _keys(k, Hv, dtype)
    vs, gs, bs = v.to(dtype), g.to(dtype), beta.to(dtype)
    S = state0.to(dtype)
    outs, states = [], []
    for t in range(q.shape[1]):
        S = torch.exp(gs[:, t])[..., None, None] * S
        delta = bs[:, t, :, None] * (vs[:, t] - torch.einsum("bhkv,bhk->bhv", S, ks[:, t]))
        S = S + ks[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qs[:, t]))
        states.append(S)
    return torch.stack(outs, 1), torch.stack(states, 1)


def _deltas(ks, vs, gs, bs, S0):
    """The WY/UT solve over L tokens from S0: (v' (n, L, H, Dv), Γ (n, L, H)).

    ks (n, L, H, Dk) normalized; vs (n, L, H, Dv); gs, bs (n, L, H); S0 (n, H, Dk, Dv); one dtype.
    """
    L = ks.shape[1]
    gam = torch.cumsum(gs, dim=1)  # Γ, non-increasing
    lower = torch.ones(L, L, dtype=torch.bool, device=ks.device).tril(-1)
    diff = (gam.transpose(1, 2)[..., :, None] - gam.transpose(1, 2)[..., None, :]).clamp_max(0.0)
    decay = torch.where(lower, torch.exp(diff), 0.0)  # (n, H, L, L): exp(Γ_i - Γ_j), j < i
    A = bs.transpose(1, 2)[..., None] * torch.einsum("nihk,njhk->nhij", ks, ks) * decay
    rhs_v = (bs[..., None] * vs).transpose(1, 2)  # (n, H, L, Dv)
    rhs_k = (bs[..., None] * torch.exp(gam)[..., None] * ks).transpose(1, 2)
    eye = torch.eye(L, dtype=ks.dtype, device=ks.device)
    U = torch.linalg.solve_triangular(eye + A, torch.cat([rhs_v, rhs_k], -1), upper=False,
                                      unitriangular=True)
    Dv = vs.shape[-1]
    v_new = U[..., :Dv] - U[..., Dv:] @ S0  # (n, H, L, Dv)
    return v_new.transpose(1, 2), gam


def _outputs(qs, ks, v_new, gam, S0, first: int):
    """o at positions first..L-1 (qs (n, L - first, H, Dk) scaled) from S0 and every v' up to each."""
    L = ks.shape[1]
    gt = gam[:, first:]  # (n, Lq, H)
    pos = torch.arange(L, device=ks.device)
    causal = pos[None, :] <= (first + torch.arange(L - first, device=ks.device))[:, None]  # (Lq, L)
    diff = (gt[:, :, None] - gam[:, None]).clamp_max(0.0)  # (n, Lq, L, H)
    w = torch.where(causal[None, :, :, None], torch.exp(diff), 0.0) * torch.einsum("nthk,njhk->ntjh", qs, ks)
    return torch.exp(gt)[..., None] * torch.einsum("nhkv,nthk->nthv", S0, qs) + torch.einsum(
        "ntjh,njhv->nthv", w, v_new)


def _fold(ks, v_new, gam, S0):
    """S after all L tokens: exp(Γ_L) S0 + Σ_j exp(Γ_L - Γ_j) k_j v'_jᵀ."""
    end = gam[:, -1]  # (n, H)
    w = torch.exp((end[:, None] - gam).clamp_max(0.0))  # (n, L, H)
    return torch.exp(end)[..., None, None] * S0 + torch.einsum("nlh,nlhk,nlhv->nhkv", w, ks, v_new)


def gdn_chunked_ref(q, k, v, g, beta, state0, *, chunk_size: int = 64, dtype: torch.dtype = torch.float32):
    """The WY/UT form over chunks of `chunk_size` tokens (what prefill runs); same contract as
    `gdn_recurrence_ref` except that it returns (o (b, L, Hv, Dv), final state (b, Hv, Dk, Dv))."""
    check_int("chunk_size", chunk_size, 1)
    Hv, Dk = v.shape[2], q.shape[-1]
    qs = _keys(q, Hv, dtype) * Dk**-0.5
    ks = _keys(k, Hv, dtype)
    vs, gs, bs = v.to(dtype), g.to(dtype), beta.to(dtype)
    S = state0.to(dtype)
    outs = []
    for c in range(0, q.shape[1], chunk_size):
        sl = slice(c, c + chunk_size)
        v_new, gam = _deltas(ks[:, sl], vs[:, sl], gs[:, sl], bs[:, sl], S)
        outs.append(_outputs(qs[:, sl], ks[:, sl], v_new, gam, S, 0))
        S = _fold(ks[:, sl], v_new, gam, S)
    return torch.cat(outs, 1), S


def gdn_chunked_varlen_ref(q, k, v, g, beta, cu_seqlens: list[int], state0, points: list[tuple[int, int]], *,
                           chunk_size: int = 64, dtype: torch.dtype = torch.float32,
                           out: torch.Tensor | None = None):
    """The chunked form over packed rows, batched over rows; returns (o, states at `points`).

    q, k (T, Hk, Dk) raw; v (T, Hv, Dv); g, beta (T, Hv): n rows back to back, row i the tokens
    cu_seqlens[i]:cu_seqlens[i + 1] (a host list), run from state0[i] (n, Hv, Dk, Dv). points (host list)
    asks for (row, length) with 0 <= length <= the row's length. Returns o (T, Hv, Dv), written into
    `out` when given (any float dtype) else in `dtype`, and the state of each point's row after its
    first `length` tokens (m, Hv, Dk, Dv) in `dtype`, in points' order.

    Each row is cut at its points into segments and the chunks restart at each segment's start, as a
    `gdn_chunked_ref` call per segment would run them. Round r runs every row's r-th segment in one
    call, right-padded to the longest (rows of very different lengths in groups: `_length_groups`):

        row 0  |a a a a a|b b b|             points (0, 5), (0, 8)
        row 1  |c c c c c c c c c c|         point (1, 10)
        round 0: [a a a a a . . . . .]  [c c c c c c c c c c]      . = padding
        round 1: [b b b]                                          (row 1 has no second segment)

    A padding token (q = k = v = 0, g = 0, beta = 0) is neutral: its row of A and its rhs are zero,
    so it adds no delta, and it decays by exp(0) = 1: the state a padded call returns is the row's
    state after its last real token. The padding outputs are dropped.
    """
    check_int("chunk_size", chunk_size, 1)
    n, T, Hv, Dv = len(cu_seqlens) - 1, q.shape[0], v.shape[1], v.shape[2]
    lens = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(n)]
    cuts: list[set[int]] = [{lens[i]} for i in range(n)]
    for row, length in points:
        if not (0 <= row < n and 0 <= length <= lens[row]):
            raise ValueError(f"points: ({row}, {length}) is outside the {n} rows of lengths {lens}")
        cuts[row].add(length)
    # segments[i]: row i's (first token, length) per round; after[i][length]: the round whose end
    # is that point (-1: the start state).
    segments: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    after: list[dict[int, int]] = [{} for _ in range(n)]
    for i in range(n):
        pos = 0
        for c in sorted(cuts[i]):
            if c > pos:
                segments[i].append((cu_seqlens[i] + pos, c - pos))
                pos = c
            after[i][c] = len(segments[i]) - 1
    num_rounds = max((len(s) for s in segments), default=0)
    by_round: list[list[int]] = [[] for _ in range(num_rounds + 1)]  # point indices, round -1 last
    for j, (row, length) in enumerate(points):
        by_round[after[row][length]].append(j)

    dev = q.device
    if out is None:
        out = torch.empty(T, Hv, Dv, dtype=dtype, device=dev)
    states = torch.empty(len(points), *state0.shape[1:], dtype=dtype, device=dev)
    S = state0.to(dtype)

    def publish(r: int) -> None:
        if by_round[r]:
            js = by_round[r]
            rows = torch.tensor([points[j][0] for j in js], device=dev)
            states[torch.tensor(js, device=dev)] = S[rows]

    publish(-1)
    for r in range(num_rounds):
        rows = [i for i in range(n) if len(segments[i]) > r]
        segs = [segments[i][r] for i in rows]
        if len(rows) == n:
            S = _chunked_padded(q, k, v, g, beta, segs, S, chunk_size, dtype, out)
        else:
            rows_t = torch.tensor(rows, device=dev)
            # Out of place: rows without an r-th segment keep their state.
            S = S.index_copy(0, rows_t, _chunked_padded(q, k, v, g, beta, segs, S[rows_t], chunk_size,
                                                        dtype, out))
        publish(r)
    return out, states


def _length_groups(lens: list[int], slack: int = 4) -> list[list[int]]:
    """Row indices (ascending within a group) split by decreasing length so that each group's padded
    size (rows x its longest) stays within `slack` x its real tokens: one long row does not pad many
    short ones. Rows of similar lengths form one group."""
    groups: list[list[int]] = []
    longest = tokens = 0
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        if groups and (len(groups[-1]) + 1) * longest <= slack * (tokens + lens[i]):
            groups[-1].append(i)
            tokens += lens[i]
        else:
            groups.append([i])
            longest = tokens = lens[i]
    return [sorted(group) for group in groups]


def _pad(t: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, n: int, longest: int) -> torch.Tensor:
    """Packed (T, ...) -> (n, longest, ...): token src[j] at flat position dst[j], zeros elsewhere."""
    p = t.new_zeros(n * longest, *t.shape[1:])
    p[dst] = t[src]
    return p.view(n, longest, *t.shape[1:])


def _chunked_padded(q, k, v, g, beta, segs: list[tuple[int, int]], S0, chunk_size: int, dtype, out):
    """Segments (first token, length >= 1) of the packed tokens from S0 (n, Hv, Dk, Dv), right-padded
    to one (rows, longest) batch per length group: writes their outputs into out, returns the states."""
    dev = q.device
    groups = _length_groups([length for _, length in segs])
    S = None if len(groups) == 1 else torch.empty_like(S0, dtype=dtype)
    for group in groups:
        n = len(group)
        longest = max(segs[i][1] for i in group)
        total = sum(segs[i][1] for i in group)
        starts, lens = torch.tensor([[segs[i][0] for i in group], [segs[i][1] for i in group]], device=dev)
        row = torch.repeat_interleave(torch.arange(n, device=dev), lens, output_size=total)
        offset = torch.arange(total, device=dev) - (torch.cumsum(lens, 0) - lens)[row]
        src, dst = starts[row] + offset, row * longest + offset  # packed token -> padded position

        padded = [_pad(t, src, dst, n, longest) for t in (q, k, v, g, beta)]
        group_t = None if S is None else torch.tensor(group, device=dev)
        o, S1 = gdn_chunked_ref(*padded, S0 if S is None else S0[group_t], chunk_size=chunk_size, dtype=dtype)
        out[src] = o.view(n * longest, *o.shape[2:])[dst].to(out.dtype)
        if S is None:
            return S1
        S[group_t] = S1
    return S


def _check_cache(state, ring_k, ring_e, ring_g, ring_start, committed) -> None:
    check_tensor("state", state, (None, None, None, None), FLOAT_DTYPES)
    num_slots, Hv, Dk, Dv = state.shape
    dev = state.device
    check_tensor("ring_k", ring_k, (num_slots, None, None, Dk), FLOAT_DTYPES, dev)
    check_group_count("ring_k", Hv, ring_k.shape[1])
    R = ring_k.shape[2]
    check_tensor("ring_e", ring_e, (num_slots, Hv, R, Dv), (torch.float32,), dev)
    check_tensor("ring_g", ring_g, (num_slots, Hv, R), (torch.float32,), dev)
    check_cursors(ring_start, committed, num_slots, dev)


def _check_step(q, k, v, g, beta, state, Hk: int, act_dtypes, out) -> None:
    """Shapes of one decode step's inputs against a (S, Hv, Dk, Dv) state pool."""
    _, Hv, Dk, Dv = state.shape
    dev = state.device
    check_tensor("q", q, (None, None, Hk, Dk), act_dtypes, dev)
    b, n = q.shape[:2]
    check_tensor("k", k, (b, n, Hk, Dk), (q.dtype,), dev)
    check_tensor("v", v, (b, n, Hv, Dv), (q.dtype,), dev)
    check_tensor("g", g, (b, n, Hv), FLOAT_DTYPES, dev)
    check_tensor("beta", beta, (b, n, Hv), FLOAT_DTYPES, dev)
    if out is not None:
        check_tensor("out", out, tuple(v.shape), (q.dtype,), dev)


def _gather_history(ring_k, ring_e, ring_g, slots, start, count, length: int):
    """First `count` ring entries of each slot as fp32 k (n, length, Hk, Dk), e (n, length, Hv, Dv),
    g (n, length, Hv), zeroed past count (a no-op entry), so rejected drafts or NaN rows past it are
    never read."""
    R = ring_k.shape[2]
    j = torch.arange(length, device=slots.device)
    rows = (start[:, None] + j) % R
    valid = (j[None, :] < count[:, None])[:, :, None]
    s = slots[:, None]
    ks = torch.where(valid[..., None], ring_k[s, :, rows].float(), 0.0)  # advanced indices go first
    es = torch.where(valid[..., None], ring_e[s, :, rows], 0.0)
    gs = torch.where(valid, ring_g[s, :, rows], 0.0)
    return ks, es, gs


def _new_deltas(ks, es, gam, vs, bs, S0, first: int):
    """e at positions first..L-1 in place, in order: beta_t (v_t - a_t S_{t-1}^T k_t) from S0 and every
    e before t. ks (n, L, H, Dk) normalized; es (n, L, H, Dv) (positions < first given); gam = Γ
    (n, L, H); vs, bs (n, L - first, H, ...) the new tokens' v and beta; S0 (n, H, Dk, Dv)."""
    for t in range(first, ks.shape[1]):
        w = torch.exp((gam[:, t, None] - gam[:, :t]).clamp_max(0.0)) * torch.einsum(
            "njhk,nhk->njh", ks[:, :t], ks[:, t])
        pred = torch.exp(gam[:, t])[..., None] * torch.einsum("nhkv,nhk->nhv", S0, ks[:, t])
        pred = pred + torch.einsum("njh,njhv->nhv", w, es[:, :t])
        es[:, t] = bs[:, t - first, :, None] * (vs[:, t - first] - pred)
    return es


def gdn_replay_forward(q, k, v, g, beta, state, ring_k, ring_e, ring_g, ring_start, committed,
                       state_indices, window: int, *, rand_seed: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """ReplaySSM decode/verify step for Gated DeltaNet, n tokens per row; returns o (b, n, Hv, Dv).

    q, k (b, n, Hk, Dk) raw; v (b, n, Hv, Dv); g (b, n, Hv) log decay <= 0; beta (b, n, Hv);
    state (S, Hv, Dk, Dv) fp32/fp16/bf16; ring_k (S, Hk, R, Dk) in q.dtype; ring_e (S, Hv, R, Dv),
    ring_g (S, Hv, R) fp32; ring_start, committed (S,) int32 (read only; `replay_commit`
    moves them); state_indices (b,) int32, -1 = padding (o rows zero, nothing touched);
    1 <= n <= window, R >= window + n. Mutates: ring rows (o + h + t) mod R of each row's slot
    (k raw, the token's e, g), and state[s] iff h + n > window (fp16/bf16 rounded
    stochastically with rand_seed).
    """
    _check_cache(state, ring_k, ring_e, ring_g, ring_start, committed)
    _check_step(q, k, v, g, beta, state, ring_k.shape[1], (ring_k.dtype,), out)
    b, n = q.shape[:2]
    check_int("window", window, 1)
    if not 1 <= n <= window:
        raise ValueError(f"q: {n} tokens per row must be in [1, window = {window}]")
    if ring_k.shape[2] < window + n:
        raise ValueError(f"ring_k: {ring_k.shape[2]} ring rows < window + tokens per row = {window + n}")
    check_indices("state_indices", state_indices, (b,), state.shape[0], state.device, unique=True)
    if state.device.type == "cpu":
        used = committed[state_indices[state_indices >= 0].long()]
        if used.numel() and int(used.max()) > window:
            raise ValueError(f"committed: cursors must be <= window = {window}, got {used.tolist()}")
    args = (q, k, v, g, beta, state, ring_k, ring_e, ring_g, ring_start, committed, state_indices, window)
    impl = pick_impl("gdn", "gdn_replay_forward", state, gdn_replay_forward_ref)
    return impl(*args, rand_seed=resolve_seed(rand_seed, state.device), out=out)


def gdn_replay_forward_ref(q, k, v, g, beta, state, ring_k, ring_e, ring_g, ring_start, committed,
                           state_indices, window: int, *, rand_seed: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of `gdn_replay_forward` (same contract): vectorized over rows, fp32 math."""
    W, R, Hv, n = window, ring_k.shape[2], v.shape[2], q.shape[1]
    if out is None:
        out = torch.empty_like(v)
    out.zero_()  # padding rows must read as zeros
    rows = (state_indices >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    slots = state_indices[rows].long()
    h, o = committed[slots].long(), ring_start[slots].long()

    # Positions 0..W-1 hold the history (no-op entries past h), W..W+n-1 the new tokens.
    hk, he, hg = _gather_history(ring_k, ring_e, ring_g, slots, o, h, W)
    ks = heads_from_groups(l2norm(torch.cat([hk, k[rows].float()], 1)), Hv)
    gam = torch.cumsum(torch.cat([hg, g[rows].float()], 1), dim=1)
    S0 = state[slots].float()
    es = torch.cat([he, he.new_zeros(len(rows), n, *he.shape[2:])], 1)
    es = _new_deltas(ks, es, gam, v[rows].float(), beta[rows].float(), S0, W)
    qs = _keys(q[rows], Hv, torch.float32) * q.shape[-1] ** -0.5
    out[rows] = _outputs(qs, ks, es, gam, S0, W).to(out.dtype)

    # Append after the history; h + n <= R, so appended rows never overlap history rows.
    app = (o[:, None] + h[:, None] + torch.arange(n, device=q.device)) % R
    ring_k[slots[:, None], :, app] = k[rows]
    ring_e[slots[:, None], :, app] = es[:, W:]
    ring_g[slots[:, None], :, app] = g[rows].float()

    # Flush: fold the history into the checkpoint.
    flush = (h + n > W).nonzero().squeeze(1)
    if flush.numel():
        S_new = _fold(ks[flush, :W], es[flush, :W], gam[flush, :W], S0[flush])
        store_states(state, slots[flush], S_new, rand_seed)
    return out


def gdn_replay_materialize(state, ring_k, ring_e, ring_g, ring_start, committed, src_indices,
                           num_entries, dst_indices, *, rand_seed: torch.Tensor | None = None) -> None:
    """state[dst] = state[src] advanced by the first n committed ring entries of src (n = 0 copies).

    Cache tensors as in `gdn_replay_forward`; src_indices, num_entries, dst_indices (m,) int32 with
    0 <= n <= committed[src]; a row with src or dst = -1 is skipped. Never modifies src; ring and
    cursors of dst are not touched (callers reset them).
    """
    _check_cache(state, ring_k, ring_e, ring_g, ring_start, committed)
    num_slots, dev = state.shape[0], state.device
    check_indices("src_indices", src_indices, (None,), num_slots, dev)
    m = src_indices.shape[0]
    check_indices("dst_indices", dst_indices, (m,), num_slots, dev, unique=True)
    check_tensor("num_entries", num_entries, (m,), (torch.int32,), dev)
    if dev.type == "cpu":
        use = (src_indices >= 0) & (dst_indices >= 0)
        src, cnt = src_indices[use].long(), num_entries[use]
        if bool(((cnt < 0) | (cnt > committed[src])).any()):
            raise ValueError(f"num_entries: need 0 <= n <= committed[src], got {num_entries.tolist()}")
        if bool(torch.isin(dst_indices[use], src_indices[use]).any()):
            raise ValueError(f"dst_indices: a destination is also a source, got {dst_indices.tolist()}")
    args = (state, ring_k, ring_e, ring_g, ring_start, committed, src_indices, num_entries, dst_indices)
    impl = pick_impl("gdn", "gdn_replay_materialize", state, gdn_replay_materialize_ref)
    return impl(*args, rand_seed=resolve_seed(rand_seed, dev))


def gdn_replay_materialize_ref(state, ring_k, ring_e, ring_g, ring_start, committed, src_indices,
                               num_entries, dst_indices, *, rand_seed: torch.Tensor | None = None) -> None:
    """PyTorch reference of `gdn_replay_materialize` (same contract): the fold over n entries."""
    rows = ((src_indices >= 0) & (dst_indices >= 0)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    src = src_indices[rows].long()
    # n <= committed <= W < R: padding to R needs no host read of max(n).
    hk, es, gs = _gather_history(ring_k, ring_e, ring_g, src, ring_start[src].long(),
                                 num_entries[rows].long(), ring_k.shape[2])
    ks = heads_from_groups(l2norm(hk), state.shape[1])
    S_new = _fold(ks, es, torch.cumsum(gs, dim=1), state[src].float())
    store_states(state, dst_indices[rows].long(), S_new, rand_seed)


def gdn_state_update(state, q, k, v, g, beta, state_indices, *, dst_indices: torch.Tensor | None = None,
                     rand_seed: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Baseline decode (ReplaySSM off): run n tokens per row through the recurrence from pooled states.

    state (S, Hv, Dk, Dv); q, k (b, n, Hk, Dk) raw; v (b, n, Hv, Dv); g, beta (b, n, Hv);
    state_indices (b,) int32 (-1 = padding: o rows zero, nothing touched). dst_indices None writes
    the final state back to state[state_indices[i]]; (b, n) int32 writes the state after token t
    to state[dst_indices[i, t]] (-1 skips), all sources read before any write (verify keeps 1 + k
    slots per request). fp16/bf16 writes round stochastically. Returns o (b, n, Hv, Dv) in q.dtype.
    """
    check_tensor("state", state, (None, None, None, None), FLOAT_DTYPES)
    check_tensor("k", k, (None, None, None, state.shape[2]), FLOAT_DTYPES, state.device)
    check_group_count("k", state.shape[1], k.shape[2])
    _check_step(q, k, v, g, beta, state, k.shape[2], FLOAT_DTYPES, out)
    b, n = q.shape[:2]
    dev = state.device
    check_indices("state_indices", state_indices, (b,), state.shape[0], dev, unique=dst_indices is None)
    if dst_indices is not None:
        check_indices("dst_indices", dst_indices, (b, n), state.shape[0], dev, unique=True)
    args = (state, q, k, v, g, beta, state_indices)
    impl = pick_impl("gdn", "gdn_state_update", state, gdn_state_update_ref)
    return impl(*args, dst_indices=dst_indices, rand_seed=resolve_seed(rand_seed, dev), out=out)


def gdn_state_update_ref(state, q, k, v, g, beta, state_indices, *,
                         dst_indices: torch.Tensor | None = None, rand_seed: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of `gdn_state_update` (same contract), fp32 math."""
    if out is None:
        out = torch.empty_like(v)
    out.zero_()
    rows = (state_indices >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    slots = state_indices[rows].long()
    # Every source state is gathered before any write: a destination may be another row's source.
    o, after = gdn_recurrence_ref(q[rows], k[rows], v[rows], g[rows], beta[rows], state[slots].float())
    out[rows] = o.to(out.dtype)
    if dst_indices is None:
        store_states(state, slots, after[:, -1], rand_seed)
        return out
    dst = dst_indices[rows].long()
    keep = dst >= 0
    store_states(state, dst[keep], after[keep], rand_seed)
    return out
