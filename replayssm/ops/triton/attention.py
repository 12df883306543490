"""Paged attention in Triton (twin of `ops/attention.py`): decode/verify rows and prefill chunks.

Both kernels read K/V straight from the paged cache through the block table (no gathered copy)
and run an online (base-2) softmax in fp32. Query j of a row sits at position context_len -
q_len + j and sees keys at positions <= it.

Decode/verify (`paged_attention_triton`, q_len <= 16). Grid (rows, kv heads): one program holds
every query of its row that reads one KV head, the G query heads of the group times the row's
q_len <= QP tokens, as the M rows of a tile:

    m = h_local * QP + j      h_local < G (query head kvh * G + h_local), j < q_len (token)

and streams the row's context in BLOCK_N-token tiles. One pass over the row's K/V per KV head:
the bytes the step must move. Rows with an empty context (no visible key) write zeros. Where the
rows x KV heads programs would leave SMs idle (few rows, e.g. one long conversation), each
program's keys are cut into SPLITS runs on a third grid axis and a second launch merges the runs'
partial sums (`decode_splits`). The count is a compile-time constant (a power of two, so at most six
variants): as a runtime argument it costs the merge a loop with a dynamic bound, or an unrolled loop
masked to the count, both slower.

Prefill (`paged_prefill_attention_triton`, any q_len). Grid (query tiles, query heads): the rows'
queries are cut into BLOCK_M-token tiles, numbered through a device prefix sum of tiles per row
(a program finds its row by binary search, so the grid needs no host sync and no row is padded to
the longest). Tiles are issued last-first, the causal tiles with the most keys leading. A tile
streams the keys every query of it sees without a mask, then the diagonal band under the causal
mask. One compiled kernel serves every length: no per-shape plan.

FP8 cache: K and V tiles load as E4M3 and convert to the query dtype in registers (exact); k_scale
folds into the score scale and v_scale into the output's normalization (both fp32), so the kernels
compute softmax(q (k_scale K)^T scale) (v_scale V) with no dequantized copy. A 16/32-bit cache has
scales 1.0 and converts nothing (its dtype is the query's).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from replayssm.ops.fp8 import FP8_DTYPE

MAX_QUERY_LEN = 16  # decode (1) and verify (1 + k) rows; longer chunks take the PyTorch path


@triton.jit
def _tile_queries(cu_ptr, row, kvh, G: tl.constexpr, QP: tl.constexpr, BLOCK_M: tl.constexpr):
    # The tile's M rows m = h_local * QP + j of one (row, KV head): token index, query head, whether
    # the row has that token (j < q_len), j and q_len.
    q_start = tl.load(cu_ptr + row)
    q_len = tl.load(cu_ptr + row + 1) - q_start
    m = tl.arange(0, BLOCK_M)
    j = m % QP
    return (q_start + j).to(tl.int64), kvh * G + m // QP, (m < G * QP) & (j < q_len), j, q_len


@triton.jit
def _store_normalized(o_ptr, acc, l_i, v_scale, tok, head, m_ok, d, d_ok, s_ot, s_oh):
    # v_scale * acc / l per query (zeros where no key was visible: l = 0), in the output's dtype.
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(o_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


# Integers that change from step to step are not specialized (Triton compiles a variant per value
# class: 1, multiples of 16, other): the block-table stride (longest row's blocks) and the row count.
@triton.jit(do_not_specialize=["s_bt"])
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, part_ptr, cu_ptr, bt_ptr, ctx_ptr, D, block_size,
                         scale_log2, v_scale,
                         s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ot, s_oh, s_bt,
                         G: tl.constexpr, QP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    # With SPLITS > 1, program (row, kvh, split) takes the split-th of SPLITS equal runs of the row's
    # key tiles and writes its unnormalized sums, running max and sum of weights (fp32) to part_ptr
    # for `_paged_merge_kernel`; a split past the row's keys writes max -inf, sums 0.
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    tok, head, m_ok, j, q_len = _tile_queries(cu_ptr, row, kvh, G, QP, BLOCK_M)
    ctx = tl.load(ctx_ptr + row)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx - q_len + j
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    lo = 0
    hi = ctx
    if SPLITS > 1:
        per = tl.cdiv(tl.cdiv(ctx, BLOCK_N), SPLITS) * BLOCK_N
        lo = tl.program_id(2) * per
        hi = tl.minimum(lo + per, ctx)
    for start in range(lo, hi, BLOCK_N):
        p = start + n
        p_ok = p < hi
        blk = tl.load(bt_ptr + row * s_bt + p // block_size, mask=p_ok, other=0).to(tl.int64)
        off = p % block_size
        kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk[:, None] * s_kb + off[:, None] * s_ks + kvh * s_kh + d[None, :],
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where((p[None, :] <= q_pos[:, None]) & p_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        v = tl.load(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vs + kvh * s_vh + d[None, :],
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        if IEEE:
            pv = tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pr.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLITS > 1:
        # part (rows, kv heads, SPLITS, BLOCK_M, BLOCK_D + 2): the sums, then max and weight sum.
        base = ((row * tl.num_programs(1) + kvh) * SPLITS + tl.program_id(2)).to(tl.int64) * BLOCK_M
        at = (base + tl.arange(0, BLOCK_M)) * (BLOCK_D + 2)
        tl.store(part_ptr + at[:, None] + d[None, :], acc)
        tl.store(part_ptr + at + BLOCK_D, m_i)
        tl.store(part_ptr + at + BLOCK_D + 1, l_i)
    else:
        _store_normalized(o_ptr, acc, l_i, v_scale, tok, head, m_ok, d, d_ok, s_ot, s_oh)


@triton.jit
def _paged_merge_kernel(o_ptr, part_ptr, cu_ptr, D, v_scale, s_ot, s_oh, G: tl.constexpr, QP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    # The SPLITS partial results of one (row, KV head) program of `_paged_decode_kernel`, rescaled to
    # their common max and normalized; a query with no visible key writes zeros.
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    tok, head, m_ok, _, _ = _tile_queries(cu_ptr, row, kvh, G, QP, BLOCK_M)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    base = (row * tl.num_programs(1) + kvh).to(tl.int64) * SPLITS * BLOCK_M
    sp = tl.arange(0, SPLITS)
    at = (base + sp[:, None] * BLOCK_M + m[None, :]) * (BLOCK_D + 2)
    mx = tl.max(tl.load(part_ptr + at + BLOCK_D), 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        at_s = (base + s * BLOCK_M + m) * (BLOCK_D + 2)
        w = tl.exp2(tl.load(part_ptr + at_s + BLOCK_D) - mx)
        l_i += w * tl.load(part_ptr + at_s + BLOCK_D + 1)
        acc += w[:, None] * tl.load(part_ptr + at_s[:, None] + d[None, :])
    _store_normalized(o_ptr, acc, l_i, v_scale, tok, head, m_ok, d, d_ok, s_ot, s_oh)


# Split keys ("flash decoding") only where (rows x KV heads) programs leave SMs idle: up to
# MAX_SPLITS runs per program, each of at least MIN_SPLIT_KEYS keys of the longest row, so that
# about 2 programs per SM work (decode at batch 1 with a long context: 8 programs otherwise).
MAX_SPLITS = 32
MIN_SPLIT_KEYS = 256


def _check_layouts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float,
                   v_scale: float) -> None:
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need unit stride in head_dim")
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in (q.dtype, FP8_DTYPE):
        raise ValueError(f"k_cache and v_cache must both be in q's dtype {q.dtype} or float8_e4m3fn, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dtype != FP8_DTYPE and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"k_scale/v_scale apply to an FP8 cache only, got {k_scale!r}, {v_scale!r}")


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_splits(programs: int, max_context_len: int, sms: int) -> int:
    """Key splits per (row, KV head) program: the largest power of two (the merge's tile) not above
    any of 2 * sms / programs (rounded up), MAX_SPLITS and max_context_len / MIN_SPLIT_KEYS; 1 when
    the programs alone give every SM two."""
    want = min(-(-2 * sms // max(programs, 1)), MAX_SPLITS, max(1, max_context_len // MIN_SPLIT_KEYS))
    return 1 << (want.bit_length() - 1)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           *, scale: float, max_query_len: int, max_context_len: int,
                           k_scale: float = 1.0, v_scale: float = 1.0, splits: int | None = None,
                           tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Same contract as `ops.attention.paged_attention` for max_query_len <= MAX_QUERY_LEN.

    q (T, heads, head_dim); k_cache, v_cache (num_blocks, block_size, kv_heads, head_dim) with
    unit stride in head_dim; cu_seqlens_q (n+1,) int32; block_tables (n, max_blocks) int32;
    context_lens (n,) int32. Returns (T, heads, head_dim) in q's dtype. fp32 inputs use IEEE
    fp32 products (exact-ish); bf16/fp16 use the tensor cores with fp32 accumulation. The caches
    are in q's dtype, or float8_e4m3fn with dequantization scales k_scale, v_scale.
    splits: key splits per (row, KV head) program, a power of two (default `decode_splits`, from the
    rows, the longest context and the SM count; a CUDA graph keeps the split of its capture, and
    each row divides its own keys); tiles: (BLOCK_N, num_warps, num_stages) for the sweeps.
    """
    T, heads, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    n = block_tables.shape[0]
    if max_query_len > MAX_QUERY_LEN:
        raise ValueError(f"max_query_len={max_query_len} exceeds the decode kernel's {MAX_QUERY_LEN}")
    _check_layouts(q, k_cache, v_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    if T == 0 or n == 0:
        return out.zero_()
    G = heads // kv_heads
    QP = triton.next_power_of_2(max(max_query_len, 1))
    block_m = max(16, triton.next_power_of_2(G * QP))
    block_d = max(16, triton.next_power_of_2(D))
    if splits is None:
        sms = _sm_count(q.device.index or 0) if q.is_cuda else 4
        splits = decode_splits(n * kv_heads, max_context_len, sms)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    # Two pipeline stages, not Triton's default three: faster at large batches of decode and verify
    # rows; key tiles of 128 where the keys split 4 ways or more (long rows).
    if tiles is not None:
        block_n, warps, stages = tiles
    elif block_m > 64:
        block_n, warps, stages = 32, 4, None
    else:
        block_n, warps, stages = (128, 4, 2) if splits >= 4 else (64, 4, 2)
    bt = block_tables.contiguous()
    part = (torch.empty(n, kv_heads, splits, block_m, block_d + 2, device=q.device, dtype=torch.float32)
            if splits > 1 else out)
    extra = {} if stages is None else {"num_stages": stages}
    _paged_decode_kernel[(n, kv_heads, splits)](
        q, k_cache, v_cache, out, part, cu_seqlens_q, bt, context_lens, D, block_size,
        scale * k_scale * math.log2(math.e), v_scale, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), bt.stride(0), G=G, QP=QP, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=warps, **extra,
    )
    if splits > 1:
        _paged_merge_kernel[(n, kv_heads)](out, part, cu_seqlens_q, D, v_scale, out.stride(0), out.stride(1),
                                           G=G, QP=QP, BLOCK_M=block_m, BLOCK_D=block_d, SPLITS=splits,
                                           num_warps=4)
    return out


@triton.jit(do_not_specialize=["n_rows", "s_bt"])
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, tiles_ptr, bt_ptr, ctx_ptr, n_rows, D,
                          scale_log2, v_scale,
                          s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ot, s_oh, s_bt,
                          G: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    total = tl.load(tiles_ptr + n_rows)
    pid = tl.program_id(0)
    if pid >= total:
        return
    t = total - 1 - pid
    head = tl.program_id(1)
    kvh = head // G
    # row: the last r with tiles[r] <= t (tiles: exclusive prefix sum of tiles per row, n_rows + 1 entries)
    lo = 0
    hi = n_rows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go = tl.load(tiles_ptr + mid) <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    row = lo
    tile = t - tl.load(tiles_ptr + row)
    q_start = tl.load(cu_ptr + row)
    q_len = tl.load(cu_ptr + row + 1) - q_start
    ctx = tl.load(ctx_ptr + row)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tok = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * s_qt + head * s_qh + d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                other=0.0)
    first = ctx - q_len + tile * BLOCK_M  # position of the tile's first query
    q_pos = first + tl.arange(0, BLOCK_M)
    end = tl.minimum(first + BLOCK_M, ctx)  # keys the tile's last real query sees, exclusive
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    # Keys below `first` are seen by every query of the tile: whole BLOCK_N tiles of them go unmasked.
    free = first // BLOCK_N * BLOCK_N
    for start in range(0, end, BLOCK_N):
        p = start + n
        causal = start >= free
        p_ok = p < end
        blk = tl.load(bt_ptr + row * s_bt + p // BS, mask=p_ok, other=0).to(tl.int64)
        off = p % BS
        kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk[:, None] * s_kb + off[:, None] * s_ks + kvh * s_kh + d[None, :],
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        if causal:
            s = tl.where((p[None, :] <= q_pos[:, None]) & p_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        v = tl.load(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vs + kvh * s_vh + d[None, :],
                    mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        if IEEE:
            pv = tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pr.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(o_ptr + tok[:, None] * s_ot + head * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def prefill_tiles(dtype: torch.dtype, head_dim: int, interpret: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel. 16-bit: 128 x 128 tiles, 8
    warps, 2 stages are the fastest of seven tiles on the H200 in every case timed (1.47 ms vs 1.66
    for 128 x 64 x 8 x 3 at 1,040 queries over 17,984 keys; 4.80 vs 5.33 ms at 8,192 over 16,384);
    3 stages come within 2% and everything else is slower. fp32 runs IEEE products (register-heavy:
    small tiles); the interpreter gets small tiles so tests cross tile edges."""
    if interpret:
        return 16, 16, 4, 1
    if dtype == torch.float32:
        return 32, 32, 4, 2
    return (128, 128, 8, 2) if head_dim <= 128 else (64, 32, 4, 2)


def paged_prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                                   context_lens: torch.Tensor, *, scale: float, max_query_len: int,
                                   max_context_len: int, k_scale: float = 1.0, v_scale: float = 1.0,
                                   tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Same contract as `ops.attention.paged_attention`, any q_len (prefill chunks, mixed batches).

    Layouts and scales as `paged_attention_triton` (the block size is compiled in). `tiles` overrides
    `prefill_tiles` (benchmarks). No host sync: the per-row tile counts are a device prefix sum and
    the grid is the bound min(n * cdiv(max_query_len, BLOCK_M), cdiv(T, BLOCK_M) + n).
    """
    T, heads, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    n = block_tables.shape[0]
    _check_layouts(q, k_cache, v_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    if T == 0 or n == 0:
        return out.zero_()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    block_m, block_n, warps, stages = tiles or prefill_tiles(q.dtype, D, interpret)
    cu = cu_seqlens_q.to(torch.int32)
    per_row = (cu[1:] - cu[:-1] + block_m - 1) // block_m
    tiles_cum = torch.zeros(n + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(per_row, 0, out=tiles_cum[1:])
    grid = min(n * triton.cdiv(max(max_query_len, 1), block_m), triton.cdiv(T, block_m) + n)
    bt = block_tables.contiguous()
    _paged_prefill_kernel[(grid, heads)](
        q, k_cache, v_cache, out, cu, tiles_cum, bt, context_lens, n, D, scale * k_scale * math.log2(math.e),
        v_scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), bt.stride(0),
        G=heads // kv_heads, BS=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)), IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )
    return out
