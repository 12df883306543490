"""Triton Gated DeltaNet kernels vs the references, shared by the GPU tests and the interpreter run.

Each `check_*` builds random inputs (never zeros) on `device`: a slot pool larger than the batch with
permuted slots and a padding row, ring rows outside each history NaN (never read), a NaN-poisoned
output. It runs the Triton twin and the fp32 `*_ref` on copies and the float64 recurrence, and asserts:

- outputs within the fp32 tolerance of the float64 recurrence and of the fp32 reference;
- fp32 states within the fp32 tolerance; 16-bit states within one ulp plus that tolerance of the
  reference's and equal to its bits for at least 99% of the elements (kernel and reference sum in
  different orders, on tensor cores or not: the fp32 values differ by rounding, near-zero elements
  of a Dk = 128 sum by more than an ulp through cancellation, and a stochastic rounding flips only
  where its random threshold falls between the two);
- appended deltas e within TOL of the reference's; the other ring rows (k, g, and every row not
  appended), cursors and every untouched slot bit-exact; a second Triton run bit-identical (`repeat`:
  races show on the GPU; the interpreter runs programs one after another and skips it).

Run as a script under TRITON_INTERPRET=1 (`gdn_triton_cases.py <part>`) it checks tiny CPU shapes.
"""

from __future__ import annotations

import sys

import torch

from replayssm.ops.gdn import (
    gdn_recurrence_ref,
    gdn_replay_forward_ref,
    gdn_replay_materialize_ref,
    gdn_state_update_ref,
)
from replayssm.ops.rounding import seed_tensor
from replayssm.ops.triton.gdn_replay import launch_materialize, launch_replay_forward
from replayssm.ops.triton.gdn_state import LaunchConfig, launch_state_update

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
TOL = 2e-4  # fp32 tolerance relative to max(|expected|, 1), outputs and fp32 states
ACT_TOL = {F32: TOL, BF16: 1.2e-2}  # bf16 outputs carry one bf16 rounding
HEADS = {"gqa1": (2, 2), "gqa4": (1, 4)}  # (Hk, Hv): 1 and 4 value heads per key head


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert not got.isnan().any(), f"{name}: NaN (unwritten output)"
    err = (got.double() - want.double()).abs().max().item()
    scale = max(want.double().abs().max().item(), 1.0)
    assert err <= tol * scale, f"{name}: max err {err:.3e} > {tol} * {scale:.3g}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _same_bits(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(_bits(got), _bits(want)), f"{name}: bits differ"


def _states_match(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: within TOL; 16-bit: within one ulp + TOL and >= 99% bit-equal (see the module docstring)."""
    if got.dtype == F32:
        _close(name, got, want, TOL)
        return
    g, w = got.float(), want.float()
    ulp = torch.where(w == 0, 2.0**-126, w.abs() * 2.0**-7)  # bf16 keeps 8 significant bits
    fp32_err = TOL * max(w.abs().max().item(), 1.0)  # the fp32 states' bound, as in `_close`
    within = (g - w).abs() <= ulp * 1.0001 + fp32_err
    assert bool(within.all()), f"{name}: beyond one ulp + the fp32 tolerance of the reference"
    equal = (_bits(got) == _bits(want)).double().mean().item()
    assert equal >= 0.99, f"{name}: only {equal:.4f} of the 16-bit states equal the reference's bits"


def _untouched(name: str, got: torch.Tensor, orig: torch.Tensor, touched: torch.Tensor) -> None:
    keep = torch.ones(orig.shape[0], dtype=torch.bool, device=orig.device)
    keep[touched[touched >= 0].long()] = False
    _same_bits(name, got[keep], orig[keep])


def _keys(shape, Dk: int, similar: bool) -> torch.Tensor:
    """Random keys; `similar`: one shared direction plus 5% noise, so k_i . k_j ~ 1 for every pair."""
    if not similar:
        return torch.randn(*shape, Dk)
    return torch.randn(Dk).expand(*shape, Dk) + 0.05 * torch.randn(*shape, Dk)


def _gates(shape, similar: bool):
    """(g, beta): log decay in [-0.8, -0.02] and beta in [0.05, 0.95]; `similar`: little decay
    (g in [-0.02, -0.001]) and beta in [0.9, 0.99], the regime where the WY solve's terms grow."""
    if similar:
        return -(torch.rand(shape) * 0.019 + 0.001), torch.rand(shape) * 0.09 + 0.9
    return -(torch.rand(shape) * 0.78 + 0.02), torch.rand(shape) * 0.9 + 0.05


def _tokens(b, n, Hk, Hv, Dk, Dv, act, device, similar=False):
    q, k = torch.randn(b, n, Hk, Dk), _keys((b, n, Hk), Dk, similar)
    v = torch.randn(b, n, Hv, Dv)
    g, beta = _gates((b, n, Hv), similar)
    return tuple(t.to(device) for t in (q.to(act), k.to(act), v.to(act), g, beta))


def _slots(b: int, S: int, device) -> torch.Tensor:
    """b distinct permuted slots of a pool of S, one of them a padding row (-1)."""
    idx = torch.randperm(S)[:b].to(torch.int32)
    idx[torch.randint(0, b, (1,))] = -1
    return idx.to(device)


def _cache(S, Hk, Hv, Dk, Dv, R, committed, state_dtype, act, device, similar=False):
    """(state, ring_k, ring_e, ring_g, ring_start, committed); e fp32, a normal times a beta from `_gates`
    (any e is the delta of some v: `_history64`); rows past each history NaN."""
    ring_start = torch.randint(0, R, (S,), dtype=torch.int32)
    committed = torch.as_tensor(committed, dtype=torch.int32)
    state = (torch.randn(S, Hv, Dk, Dv) * 0.5).to(state_dtype)
    g, beta = _gates((S, Hv, R), similar)
    ring = [_keys((S, Hk, R), Dk, similar).to(act), torch.randn(S, Hv, R, Dv) * beta[..., None], g]
    for s in range(S):
        free = [r for r in range(R) if (r - int(ring_start[s])) % R >= int(committed[s])]
        for t in ring:
            t[s][:, free] = float("nan")
    return [t.to(device) for t in (state, *ring, ring_start, committed)]


def _history64(cache, s: int, n: int):
    """The first n ring entries of slot s as float64 tokens that produce them from its checkpoint:
    k (n, Hk, Dk), v (n, Hv, Dv), g, beta (n, Hv), with beta_t = 1 and v_t = e_t + a_t S_{t-1}^T k_t (the
    ring keeps no beta: e carries it, and any e is the delta of this v)."""
    state, rk, re, rg, start, _ = cache
    rows = [(int(start[s]) + j) % rk.shape[2] for j in range(n)]
    k, e = rk[s][:, rows].transpose(0, 1).double().cpu(), re[s][:, rows].transpose(0, 1).double().cpu()
    g = rg[s][:, rows].T.double().cpu()
    beta = torch.ones_like(g)
    Hv = e.shape[1]
    kn = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    kn = kn.repeat_interleave(Hv // k.shape[1], dim=1)
    S, v = state[s].double().cpu(), []
    for t in range(n):
        S = torch.exp(g[t])[:, None, None] * S
        v.append(e[t] + torch.einsum("hkv,hk->hv", S, kn[t]))
        S = S + kn[t][:, :, None] * e[t][:, None, :]
    v = torch.stack(v) if v else e
    return tuple(t.to(state.device) for t in (k, v, g, beta))


def _recurrence64(S0, q, k, v, g, beta):
    """Float64 recurrence over one sequence: (o (n, Hv, Dv), states (n, Hv, Dk, Dv))."""
    o, states = gdn_recurrence_ref(q[None], k[None], v[None], g[None], beta[None], S0[None], dtype=F64)
    return o[0], states[0]


def check_state_update(device, *, Hk, Hv, Dk, Dv, b, S, n, verify, state_dtype, act, block_v=32, repeat=True):
    """Baseline decode (n tokens, state written back) or verify (the state after each token to its own
    slot, -1 skipping some) matches the recurrence; nothing else moves."""
    torch.manual_seed(n * 7 + Hv)
    state = (torch.randn(S, Hv, Dk, Dv) * 0.5).to(state_dtype).to(device)
    perm = torch.randperm(S).to(torch.int32)
    idx = perm[:b].clone()
    idx[1] = -1
    idx = idx.to(device)
    dst = None
    if verify:  # each row's destinations: its own source first, then fresh slots; some skipped
        dst = perm[b : b + b * n].view(b, n).clone()
        dst[:, 0] = perm[:b]
        dst[0, -1] = -1
        dst = dst.to(device)
    step = _tokens(b, n, Hk, Hv, Dk, Dv, act, device)
    seed = seed_tensor(11, device)
    want_state = state.clone()
    want = gdn_state_update_ref(want_state, *step, idx, dst_indices=dst, rand_seed=seed)
    got_state = state.clone()
    out = torch.full_like(step[2], float("nan"))
    cfg = LaunchConfig(block_v=block_v)
    got = launch_state_update(got_state, *step, idx, dst, seed, out, cfg)
    assert got is out
    _close("o vs reference", got, want, ACT_TOL[act])
    _states_match("state", got_state, want_state)
    _untouched("untouched slots", got_state, state, idx if dst is None else torch.cat([idx, dst.flatten()]))
    for i, s in enumerate(idx.tolist()):
        if s < 0:
            assert bool((got[i] == 0).all()), "padding row output not zero"
            continue
        o64, states64 = _recurrence64(state[s].double(), *(t[i].double() for t in step))
        _close(f"o row {i} vs float64", got[i], o64, ACT_TOL[act])
        if state_dtype == F32:
            writes = [(dst[i, t].item(), states64[t]) for t in range(n)] if verify else [(s, states64[-1])]
            for d, st in writes:
                if d >= 0:
                    _close(f"state row {i} -> {d} vs float64", got_state[d], st, TOL)
    if not repeat:
        return
    again = state.clone()
    launch_state_update(again, *step, idx, dst, seed, None, cfg)
    _same_bits("second run", again, got_state)


def check_replay(device, *, Hk, Hv, Dk, Dv, n, W, state_dtype, act, block_v=32, num_warps=4, repeat=True,
                 similar=False):
    """A replay step over rows holding every ring fill 0..W (flush iff h + n > W) plus a padding row:
    outputs, flushed checkpoints and appended ring rows match; cursors and other slots never move.
    `similar`: nearly parallel keys, beta near 1 and little decay (`_keys`, `_gates`)."""
    torch.manual_seed(n * 13 + Hv + W)
    fills = list(range(W + 1))
    b = len(fills) + 1
    S, R = b + 3, W + n
    idx = _slots(b, S, device)
    committed = torch.randint(0, W + 1, (S,), dtype=torch.int32)
    rows = [i for i in range(b) if int(idx[i]) >= 0]
    for i, h in zip(rows, fills):
        committed[int(idx[i])] = h
    cache = _cache(S, Hk, Hv, Dk, Dv, R, committed, state_dtype, act, device, similar)
    step = _tokens(b, n, Hk, Hv, Dk, Dv, act, device, similar)
    seed = seed_tensor(5, device)
    want_cache = [t.clone() for t in cache]
    want = gdn_replay_forward_ref(*step, *want_cache, idx, W, rand_seed=seed)
    got_cache = [t.clone() for t in cache]
    out = torch.full_like(step[2], float("nan"))
    cfg = LaunchConfig(block_v=block_v, num_warps=num_warps)
    got = launch_replay_forward(*step, *got_cache, idx, W, seed, out, cfg)
    assert got is out
    _close("o vs reference", got, want, ACT_TOL[act])
    _states_match("state", got_cache[0], want_cache[0])
    appended = torch.zeros_like(cache[2], dtype=torch.bool)
    for s in idx.tolist():
        if s >= 0:
            for t in range(n):
                appended[s, :, (int(cache[4][s]) + int(committed[s]) + t) % R] = True
    _close("appended e", got_cache[2][appended], want_cache[2][appended], TOL)
    _same_bits("ring_e rows not appended", got_cache[2][~appended], cache[2][~appended])
    for name, g_, w_ in zip(("ring_k", "ring_g", "ring_start", "committed"),
                            (got_cache[1], *got_cache[3:]), (want_cache[1], *want_cache[3:])):
        _same_bits(name, g_, w_)
    _untouched("untouched slots", got_cache[0], cache[0], idx)
    for i, s in enumerate(idx.tolist()):
        if s < 0:
            assert bool((got[i] == 0).all()), "padding row output not zero"
            continue
        h = int(committed[s])
        hk, hv, hg, hb = _history64(cache, s, h)
        q, k, v, g, beta = (t[i].double() for t in step)
        dummy_q = torch.zeros_like(hk)
        o64, states64 = _recurrence64(cache[0][s].double(), torch.cat([dummy_q, q]), torch.cat([hk, k]),
                                      torch.cat([hv, v]), torch.cat([hg, g]), torch.cat([hb, beta]))
        _close(f"o row {i} (h = {h}) vs float64", got[i], o64[h:], ACT_TOL[act])
        if h + n <= W:
            _same_bits(f"row {i} (h = {h}) without flush keeps its state", got_cache[0][s], cache[0][s])
        elif state_dtype == F32:
            _close(f"flushed state row {i} (h = {h}) vs float64", got_cache[0][s], states64[h - 1], TOL)
    if not repeat:
        return
    again = [t.clone() for t in cache]
    launch_replay_forward(*step, *again, idx, W, seed, None, cfg)
    for g_, w_ in zip(again, got_cache):
        _same_bits("second run", g_, w_)


def check_materialize(device, *, Hk, Hv, Dk, Dv, W, state_dtype, act, block_v=32, num_warps=4):
    """state[dst] = state[src] advanced by n = 0..committed ring entries (n = 0 copies exactly); sources,
    rings and other slots untouched; padding rows skipped."""
    torch.manual_seed(Hv * 3 + W)
    m = W + 2
    S, R = 2 * m + 2, W + 1
    perm = torch.randperm(S).to(torch.int32)
    src, dst = perm[:m].clone(), perm[m : 2 * m].clone()
    committed = torch.randint(0, W + 1, (S,), dtype=torch.int32)
    num = torch.tensor([min(j, int(committed[s])) for j, s in enumerate(src.tolist())], dtype=torch.int32)
    src[-1] = -1
    dst[-2] = -1
    src, dst, num = src.to(device), dst.to(device), num.to(device)
    cache = _cache(S, Hk, Hv, Dk, Dv, R, committed, state_dtype, act, device)
    seed = seed_tensor(3, device)
    want_cache = [t.clone() for t in cache]
    gdn_replay_materialize_ref(*want_cache, src, num, dst, rand_seed=seed)
    got_cache = [t.clone() for t in cache]
    cfg = LaunchConfig(block_v=block_v, num_warps=num_warps)
    launch_materialize(*got_cache[:5], src, num, dst, seed, cfg)
    _states_match("state", got_cache[0], want_cache[0])
    for g_, w_ in zip(got_cache[1:], cache[1:]):
        _same_bits("ring / cursors", g_, w_)
    written = torch.where((src >= 0) & (dst >= 0), dst, -1)
    _untouched("untouched slots", got_cache[0], cache[0], written)
    for i in range(m):
        s, d, cnt = int(src[i]), int(dst[i]), int(num[i])
        if s < 0 or d < 0:
            continue
        if cnt == 0:
            _same_bits(f"n = 0 copy row {i}", got_cache[0][d], cache[0][s])
        elif state_dtype == F32:
            k, v, g, beta = _history64(cache, s, cnt)
            want_s = _recurrence64(cache[0][s].double(), k, k, v, g, beta)[1][-1]  # q does not touch S
            _close(f"row {i} (n = {cnt}) vs float64", got_cache[0][d], want_s, TOL)


# Interpreter parts: tiny shapes, Dv split into two tiles (block_v = 16, the smallest tl.dot dim),
# W = 4 (fills 0..4).
SMALL = dict(Dk=48, Dv=32, block_v=16, repeat=False)


def _part_state_update(state_dtype):
    def run():
        for (Hk, Hv) in HEADS.values():
            check_state_update("cpu", Hk=Hk, Hv=Hv, b=4, S=24, n=1, verify=False, state_dtype=state_dtype,
                               act=BF16, **SMALL)
            check_state_update("cpu", Hk=Hk, Hv=Hv, b=3, S=24, n=4, verify=True, state_dtype=state_dtype,
                               act=F32, **SMALL)
    return run


def _part_replay(n, state_dtype):
    def run():
        for (Hk, Hv) in HEADS.values():
            check_replay("cpu", Hk=Hk, Hv=Hv, n=n, W=4, state_dtype=state_dtype, act=state_dtype, **SMALL)
    return run


def _part_materialize(state_dtype):
    def run():
        for (Hk, Hv) in HEADS.values():
            check_materialize("cpu", Hk=Hk, Hv=Hv, W=4, state_dtype=state_dtype, act=BF16, Dk=48, Dv=32,
                              block_v=16)
    return run


def _part_replay_similar():
    """W = 16 (every fill 0..16, a 32-row solve) on nearly parallel keys, fp32 throughout."""
    check_replay("cpu", Hk=1, Hv=2, n=4, W=16, state_dtype=F32, act=F32, similar=True, **SMALL)


DTYPES = (("fp32", F32), ("bf16", BF16))
PARTS = {"replay_similar": _part_replay_similar,
         **{f"materialize_{name}": _part_materialize(sd) for name, sd in DTYPES},
         **{f"state_update_{name}": _part_state_update(sd) for name, sd in DTYPES},
         **{f"replay_q{n}_{name}": _part_replay(n, sd) for n in (1, 4) for name, sd in DTYPES}}


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(PARTS):
        PARTS[name]()
        print(f"ok {name}")
