"""Triton chunked SSD scan vs `ssd_chunked_scan_ref` and the float64 oracle (interpreter and GPU).

`check_ssd_scan` builds random packed sequences (padding sequence, empty sequence, mixed initial
states, a permuted pool larger than the batch with NaN in slots that must not be read), runs the
Triton launches twice into NaN-poisoned outputs, and asserts: bit-identical runs, outputs, final
and boundary states close to the reference and to the float64 oracle, padding outputs zero, every
untouched slot bit-exact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# The float64 oracle lives in tests/ (on the path under pytest, not in the interpreter subprocess).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ssm_oracle import softplus_dt, ssm_recurrence  # noqa: E402

from replayssm.ops.common import store_states  # noqa: E402
from replayssm.ops.rounding import seed_tensor  # noqa: E402
from replayssm.ops.ssd import scan_without_boundaries, ssd_chunked_scan_ref  # noqa: E402
from replayssm.ops.ssd_layout import chunk_layout  # noqa: E402

# Whether `ssd_chunked_scan_triton` runs the Triton scan (else the reference scan + Triton boundaries).
ENTRY_IS_FULL = True
ORACLE_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
REF_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the largest magnitude (NaN counts as infinite)."""
    err = (got.double().cpu() - want.double().cpu()).abs()
    if bool(err.isnan().any()):
        return float("inf")
    return (err.max() / want.double().abs().max().clamp(min=1e-12)).item() if err.numel() else 0.0


def _same(u: torch.Tensor, v: torch.Tensor) -> bool:
    """Bit-identical (NaN included)."""
    u, v = u.contiguous(), v.contiguous()
    return u.shape == v.shape and torch.equal(u.view(torch.uint8), v.view(torch.uint8))


def _boundaries(lengths: list[int], every: int) -> tuple[list[int], list[int]]:
    """Per sequence: 0, one random length, every `every` tokens, and the whole length (deduplicated)."""
    seq, lens = [], []
    for i, n in enumerate(lengths):
        picks = {0, n, int(torch.randint(0, n + 1, ()).item())} | set(range(every, n + 1, every))
        for b in sorted(picks):
            seq.append(i)
            lens.append(b)
    return seq, lens


def check_ssd_scan(device, *, lengths, H=4, G=2, P=24, N=20, chunk=16, act=torch.float32,
                   state_dtype=torch.float32, pad_seq=1, full=True, every=None, oracle_seqs=None,
                   softplus=True, seed=0, config=None) -> None:
    """Triton scan (full=False: reference scan + Triton boundary kernel) vs reference and oracle.

    Boundaries: 0, a random length, every `every` tokens (default: every chunk end) and the whole
    length of each sequence. oracle_seqs: the sequences checked against the oracle (default all).
    config: the scan's `LaunchConfig` (default: the module's); the public entry always runs its own.
    """
    from replayssm.ops.triton import ssd as tssd

    torch.manual_seed(seed)
    n, S = len(lengths), len(lengths) + 4
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    x = torch.randn(T, H, P).to(act)
    dt = torch.randn(T, H) - 1.0
    A = -torch.empty(H).uniform_(0.5, 4.0)
    B = (torch.randn(T, G, N) / N**0.5).to(act)
    C = torch.randn(T, G, N).to(act)
    D, dt_bias = torch.randn(H), torch.randn(H) * 0.5
    if not softplus:  # Δ = dt + dt_bias must stay positive
        dt, dt_bias = dt.abs() + 0.05, dt_bias.abs()
    slots = torch.randperm(S)[:n].to(torch.int32)
    if pad_seq is not None:
        slots[pad_seq] = -1
    has_init = torch.arange(n) % 3 != 1
    pool = (torch.randn(S, H, P, N) * 2).to(state_dtype)
    for i in range(n):  # a slot that starts from zeros must not be read
        if slots[i] >= 0 and not has_init[i]:
            pool[slots[i]] = float("nan")
    bseq, blen = _boundaries(lengths, every or chunk)
    bseq, blen = torch.tensor(bseq, dtype=torch.int32), torch.tensor(blen, dtype=torch.int32)
    cpu = (x, dt, A, B, C, D, dt_bias)
    dev = [t.to(device) for t in cpu]
    meta = [t.to(device) for t in (cu, slots, has_init, bseq, blen)]

    pool_ref = pool.clone()
    y_ref, b_ref = ssd_chunked_scan_ref(*cpu, pool_ref, cu, slots, has_init, chunk_size=chunk,
                                        rand_seed=seed_tensor(5), dt_softplus=softplus, boundary_seq=bseq,
                                        boundary_len=blen)
    runs = []
    for _ in range(2):
        st = pool.clone().to(device)
        lay = chunk_layout(*meta, chunk, T)
        y = torch.full((T, H, P), float("nan"), dtype=act, device=device)
        b = torch.full((len(bseq), H, P, N), float("nan"), device=device)
        if full:
            y, s_in = tssd.launch_scan(*dev, st, lay, chunk, softplus, 5, config or tssd.CONFIG, y=y)
        else:
            y, (_, s_in, *_) = scan_without_boundaries(*dev, st, lay, chunk, softplus, seed_tensor(5, device))
        b = tssd.launch_boundaries(*dev[:4], dev[6], st, lay, s_in, softplus, out=b)
        runs.append((y, b, st))
    (y, b, st), again = runs[0], runs[1]
    assert all(_same(u, v) for u, v in zip(again, runs[0])), "two runs differ"
    st_pub = pool.clone().to(device)
    y_pub, b_pub = tssd.ssd_chunked_scan_triton(*dev, st_pub, *meta[:3], chunk_size=chunk,
                                                rand_seed=seed_tensor(5, device), dt_softplus=softplus,
                                                boundary_seq=meta[3], boundary_len=meta[4])
    if full == ENTRY_IS_FULL and config is None:
        assert _same(y_pub, y) and _same(b_pub, b) and _same(st_pub, st), "entry differs"
    runs = ((tssd.ssd_chunked_scan_triton, dev, meta, st_pub, b_pub),
            (ssd_chunked_scan_ref, cpu, [cu, slots, has_init, bseq, blen], pool_ref, b_ref))
    _check_boundary_dst(pool, runs, dict(chunk_size=chunk, dt_softplus=softplus))

    tag = f"lengths={lengths} chunk={chunk} {act} pool {state_dtype} full={full}"
    assert (e := _rel_err(y, y_ref)) < REF_RTOL[act], f"{tag}: y vs ref {e:.2e}"
    assert (e := _rel_err(b, b_ref)) < 1e-5, f"{tag}: boundaries vs ref {e:.2e}"
    valid = slots[slots >= 0].long()
    e = _rel_err(st[valid].float(), pool_ref[valid].float())
    assert e < REF_RTOL[state_dtype], f"{tag}: final states vs ref {e:.2e}"
    keep = torch.ones(S, dtype=torch.bool)
    keep[valid] = False
    assert _same(st.cpu()[keep], pool[keep]), f"{tag}: an untouched slot changed"
    for i in range(n) if oracle_seqs is None else oracle_seqs:
        s = slice(int(cu[i]), int(cu[i + 1]))
        if slots[i] < 0:
            assert bool((y[s] == 0).all()), f"{tag}: padding sequence output not zero"
        s0 = torch.zeros(H, P, N, dtype=torch.float64)
        if slots[i] >= 0 and has_init[i]:
            s0 = pool[slots[i]].double()
        delta = softplus_dt(dt[s], dt_bias) if softplus else dt[s].double() + dt_bias.double()
        y_o, final, states = ssm_recurrence(s0, x[s], delta, A, B[s], C[s], D)
        if slots[i] >= 0 and lengths[i]:
            assert (e := _rel_err(y[s], y_o)) < ORACLE_RTOL[act], f"{tag}: y of seq {i} vs oracle {e:.2e}"
        if slots[i] >= 0:
            e = _rel_err(st[slots[i]], final)
            assert e < ORACLE_RTOL[state_dtype], f"{tag}: final state {i} vs oracle {e:.2e}"
        for j in (bseq == i).nonzero().flatten().tolist():
            want = s0 if blen[j] == 0 else states[blen[j] - 1]
            assert (e := _rel_err(b[j], want)) < 1e-5, f"{tag}: boundary {j} (seq {i}, len {blen[j]}) {e:.2e}"


def _check_boundary_dst(pool, runs, kw) -> None:
    """boundary_dst stores the boundary states into free slots with `store_states`'s bits: each run
    (entry, inputs, metadata, its pool after the plain call, its fp32 boundaries) against itself."""
    S, m = pool.shape[0], runs[0][2][3].shape[0]
    big = torch.cat([pool, torch.full((m + 3, *pool.shape[1:]), float("nan")).to(pool.dtype)])
    dst = (S + torch.randperm(m + 3)[:m]).to(torch.int32)
    for fn, args, meta_of, final, states in runs:
        device = args[0].device
        got = big.clone().to(device)
        _, none = fn(*args, got, *meta_of[:3], boundary_seq=meta_of[3], boundary_len=meta_of[4],
                     boundary_dst=dst.to(device), rand_seed=seed_tensor(5, device), **kw)
        want = big.clone().to(device)
        want[:S] = final
        store_states(want, dst.long().to(device), states, seed_tensor(5, device))
        assert none is None and _same(got, want), f"boundary_dst ({fn.__name__}) differs from store_states"


def run_interpreter() -> None:
    """Small CPU shapes under TRITON_INTERPRET=1: odd H/P/N (masked tiles), chunks below 16 (padded)."""
    run_small("cpu")


def run_small(device: str) -> None:
    """The small cases (the interpreter's; on the GPU they compile with other tiles and layouts)."""
    # The tiny test checkpoints' Mamba shape (tests/checkpoints.py): bf16 prompts of a batch.
    check_ssd_scan(device, lengths=[5, 17, 33, 9], H=8, G=2, P=16, N=16, chunk=8, act=torch.bfloat16,
                   pad_seq=None, seed=7)
    check_ssd_scan(device, lengths=[9, 1, 40, 0, 23, 16, 5], chunk=16, full=False, every=5)
    full = True
    check_ssd_scan(device, lengths=[9, 1, 40, 0, 23, 16, 5], chunk=16, full=full, every=5)
    check_ssd_scan(device, lengths=[17, 3, 0, 8], H=6, G=3, P=20, N=12, chunk=8, act=torch.bfloat16,
                   state_dtype=torch.float16, pad_seq=2, full=full, seed=1)
    check_ssd_scan(device, lengths=[0, 0], chunk=16, pad_seq=None, state_dtype=torch.float16, full=full,
                   seed=2)
    check_ssd_scan(device, lengths=[33, 32], H=2, G=1, P=16, N=16, chunk=32, act=torch.bfloat16,
                   state_dtype=torch.bfloat16, pad_seq=None, full=full, seed=3)
    # The model's chunk size: a sequence across a chunk end, a boundary every 16 tokens.
    check_ssd_scan(device, lengths=[140, 5, 9], H=2, G=1, P=16, N=32, chunk=128, full=full, every=16, seed=4)
    # No softplus; a chunk size that is not a power of two (padded positions inside every chunk).
    check_ssd_scan(device, lengths=[26, 12, 7], H=2, G=2, P=16, N=16, chunk=12, full=full, softplus=False,
                   seed=5)
    # Other launch configs: two 16-position blocks per output program (two row blocks a chunk), P and N
    # tiles in the pass, other state tiles.
    from replayssm.ops.triton.ssd import LaunchConfig

    check_ssd_scan(device, lengths=[70, 5, 33], H=3, G=1, P=20, N=24, chunk=64, act=torch.bfloat16, every=9,
                   seed=6, config=LaunchConfig(block_k=16, rows=32, nb=16, pass_block_p=16, pass_block_n=16,
                                               state_block_p=16, state_block_k=32))
