"""Paged attention over a block KV cache (PyTorch reference; Triton for decode/verify rows on CUDA).

Cache layout per attention layer: k_cache, v_cache (num_blocks, block_size, kv_heads, head_dim).
Token t of a sequence lives at block_table[t // block_size], offset t % block_size; the flat
`slot_mapping` index of a token is block * block_size + offset.

One call serves a packed batch of query chunks: row i has q_len_i = cu_seqlens_q[i+1] -
cu_seqlens_q[i] new tokens at positions context_lens[i] - q_len_i .. context_lens[i] - 1, and
attends causally to every cached key at positions 0 .. its own position (prior context,
previous chunks and earlier tokens of this chunk). Prefill chunks, decode (q_len = 1) and
speculative verify rows (q_len = 1 + k) are the same case. On CUDA, `ops/triton/attention.py`
runs them: its decode kernel when every row has q_len <= 16 (decode and verify steps), its prefill
kernel otherwise; without CUDA or Triton, `paged_attention_ref` (gathered K/V and SDPA).

FP8 cache (`--kv-cache-dtype fp8`): the caches are float8_e4m3fn and each layer has two per-tensor
fp32 scales, k_scale and v_scale. `store_kv` writes (k / k_scale) saturated to +-448 in E4M3 (one
fused Triton kernel on CUDA); every read takes k_cache * k_scale and v_cache * v_scale. A 16- or
32-bit cache takes scales of 1.0.
The Triton kernels convert E4M3 to the query dtype on load (exact: every E4M3 value is a bf16 and
an fp16) and apply the scales in fp32, k_scale to the scores and v_scale to the output, which is
the dequantized math with one rounding fewer. E4M3 loads need compute capability 8.9 (Ada,
Hopper); older GPUs take the PyTorch path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from replayssm.ops.fp8 import FP8_DTYPE, FP8_MAX

# Upper bound on the K/V gathered for one group of rows (the PyTorch path copies each row's
# context out of the paged cache before calling SDPA).
_GATHER_BUDGET_BYTES = 256 << 20


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for the config's kv_cache_dtype: auto keeps the model dtype."""
    assert name in ("auto", "fp8", "fp8_e4m3"), name  # CacheConfig checks the user's value
    return model_dtype if name == "auto" else FP8_DTYPE


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k, v (T, kv_heads, head_dim) into the caches at flat slots slot_mapping (T,) int (all >= 0).

    An FP8 cache stores (k / k_scale) and (v / v_scale) in E4M3 (`quantize_kv`), rounded to nearest
    and saturated to +-448; other caches store k and v in their dtype (scales 1.0). On CUDA an FP8
    cache takes the fused Triton store (ops/triton/fp8_kv.py, bit-exact with this path)."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be (T, kv_heads, head_dim), got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"k_cache/v_cache must be (num_blocks, block_size, {k.shape[1]}, {k.shape[2]}), "
                         f"got {tuple(k_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int ({k.shape[0]},), got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if not slot_mapping.is_cuda and bool((slot_mapping < 0).any()):
        raise ValueError("slot_mapping has negative entries: pass only real tokens")
    _check_scales(k_cache, k_scale, v_scale)
    if k.is_cuda and k_cache.dtype == FP8_DTYPE and k_cache.is_contiguous() and v_cache.is_contiguous():
        try:
            from replayssm.ops.triton.fp8_kv import store_kv_fp8_triton
        except ImportError:
            pass
        else:
            return store_kv_fp8_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    kv_heads, head_dim = k.shape[1:]
    idx = slot_mapping.long()
    k_cache.view(-1, kv_heads, head_dim)[idx] = quantize_kv(k, k_scale, k_cache.dtype)
    v_cache.view(-1, kv_heads, head_dim)[idx] = quantize_kv(v, v_scale, v_cache.dtype)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype: x * (1 / scale) in fp32, saturated to +-448, as E4M3 for an FP8 cache.

    The product with the fp32-rounded reciprocal (not a division) is what CUDA's tensor-by-scalar
    division computes anyway, and what the Triton store (ops/triton/fp8_kv.py) matches bit for bit."""
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check_scales(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    if k_cache.dtype == FP8_DTYPE:
        if not (k_scale > 0 and v_scale > 0 and math.isfinite(k_scale) and math.isfinite(v_scale)):
            raise ValueError(f"k_scale and v_scale must be finite and > 0, got {k_scale!r}, {v_scale!r}")
    elif k_scale != 1.0 or v_scale != 1.0:
        raise ValueError(f"k_scale/v_scale apply to an FP8 cache only; this cache is {k_cache.dtype} and "
                         f"takes 1.0, got {k_scale!r}, {v_scale!r}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of packed query chunks against the paged cache (see paged_attention_ref)."""
    args = (q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens)
    kw = dict(scale=scale, max_query_len=max_query_len, max_context_len=max_context_len,
              k_scale=k_scale, v_scale=v_scale)
    if q.is_cuda and q.shape[0] and block_tables.shape[0] and _triton_reads(k_cache):
        _check_shapes(*args)
        try:
            from replayssm.ops.triton.attention import (
                MAX_QUERY_LEN,
                paged_attention_triton,
                paged_prefill_attention_triton,
            )
        except ImportError:
            pass
        else:
            if max_query_len <= MAX_QUERY_LEN:
                return paged_attention_triton(*args, **kw)
            return paged_prefill_attention_triton(*args, **kw)
    return paged_attention_ref(*args, **kw)


def _triton_reads(k_cache: torch.Tensor) -> bool:
    """Whether the Triton kernels can load this cache: any 16/32-bit one; E4M3 from capability 8.9."""
    return k_cache.dtype != FP8_DTYPE or torch.cuda.get_device_capability(k_cache.device) >= (8, 9)


def _check_shapes(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens) -> None:
    T, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    n = block_tables.shape[0]
    if heads % kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q heads/head_dim {heads}/{head_dim} do not fit the cache {tuple(k_cache.shape)}")
    if cu_seqlens_q.shape != (n + 1,) or context_lens.shape != (n,):
        raise ValueError(f"cu_seqlens_q must be ({n + 1},) and context_lens ({n},), got "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(context_lens.shape)}")


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of packed query chunks against the paged cache (their own K/V already stored).

    q (T, heads, head_dim); cu_seqlens_q (n+1,) int32; block_tables (n, max_blocks) int32 (unused
    entries may be -1); context_lens (n,) int32 = tokens cached for the row including this chunk.
    max_query_len / max_context_len are host ints (upper bounds) so nothing syncs. Returns
    (T, heads, head_dim) in q's dtype; softmax in fp32. An FP8 cache is read as cache * scale,
    computed in fp32 and rounded once to q's dtype.
    """
    _check_shapes(q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens)
    _check_scales(k_cache, k_scale, v_scale)
    fp8 = k_cache.dtype == FP8_DTYPE
    kv_dtype = q.dtype if fp8 else k_cache.dtype
    T, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    n = block_tables.shape[0]
    if T == 0 or n == 0:
        return q.new_zeros(q.shape)
    dev = q.device
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    row = torch.repeat_interleave(torch.arange(n, device=dev), q_lens, output_size=T)
    col = torch.arange(T, device=dev) - cu[row]
    q_pad = q.new_zeros(n, max_query_len, heads, head_dim)
    q_pad[row, col] = q

    # Query j of row i sits at position context_len - q_len + j and sees keys at positions <= it.
    q_pos = (context_lens.long() - q_lens)[:, None] + torch.arange(max_query_len, device=dev)[None]
    mask = torch.arange(max_context_len, device=dev)[None, None, :] <= q_pos[:, :, None]
    mask[:, :, 0] = True  # padding queries see key 0 instead of nothing (no NaN); they are dropped
    # GQA without copying K/V per head: the g query heads sharing a KV head become g * max_q
    # query rows of that KV head.
    g = heads // kv_heads
    q_grp = q_pad.view(n, max_query_len, kv_heads, g, head_dim).permute(0, 2, 3, 1, 4)
    q_grp = q_grp.reshape(n, kv_heads, g * max_query_len, head_dim).to(kv_dtype)
    mask = mask[:, None, None].expand(n, 1, g, max_query_len, max_context_len)
    mask = mask.reshape(n, 1, g * max_query_len, max_context_len)
    num_blocks = -(-max_context_len // block_size)
    # Rows are processed in groups so the gathered K/V stay under a fixed budget.
    row_bytes = 2 * num_blocks * block_size * kv_heads * head_dim * q_grp.element_size()
    rows_per_group = max(1, _GATHER_BUDGET_BYTES // row_bytes)
    outs = []
    for i in range(0, n, rows_per_group):
        j = min(n, i + rows_per_group)
        blocks = block_tables[i:j, :num_blocks].long().clamp(min=0)
        k = k_cache[blocks].reshape(j - i, num_blocks * block_size, kv_heads, head_dim)[:, :max_context_len]
        v = v_cache[blocks].reshape(j - i, num_blocks * block_size, kv_heads, head_dim)[:, :max_context_len]
        if fp8:
            k, v = (k.float() * k_scale).to(kv_dtype), (v.float() * v_scale).to(kv_dtype)
        outs.append(F.scaled_dot_product_attention(q_grp[i:j], k.transpose(1, 2), v.transpose(1, 2),
                                                   attn_mask=mask[i:j], scale=scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    out = out.view(n, kv_heads, g, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(n, max_query_len, heads, head_dim)[row, col].to(q.dtype)
