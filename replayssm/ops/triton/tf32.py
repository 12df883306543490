"""fp32-accurate tensor-core products from TF32 passes (shared by the decode and prefill kernels).

A TF32 pass keeps 10 of fp32's 23 mantissa bits of each operand. An fp32 value v splits exactly
into hi (its low 13 mantissa bits cleared, exact in TF32) and lo = v - hi (exact in fp32, rounded
to TF32 in the pass: ~2^-22 of v lost). A 16-bit operand (bf16/fp16 activations, ring rows) is
exact in TF32 already, so a product with one such operand needs two passes (hi and lo of the
other), and one with two needs one; only fp32 x fp32 takes Triton's three ("tf32x3").

`dot_out` is for products that only reach a 16-bit output (route MonoMMA's outputs y with
bf16/fp16 activations): one pass, whose ~2^-11 relative error per operand is below the output's
own rounding at the scale of its terms (2^-9 for bf16, 2^-11 for fp16), where dot_split's extra
passes buy bits the store throws away. Nothing a pass rounds reaches a stored state: folds keep
dot_split or fp32.

`dot_bf16_split` is the same split at bf16 width for an fp32 operand against a bf16 one: hi = bf16(v),
lo = bf16(v - hi), two bf16 products (~2^-17 of each term: between one TF32 pass and dot_split),
for products that only reach 16-bit outputs (route Stream's state products with bf16 C).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tf32_hi(v):
    """v (fp32) with its low 13 mantissa bits cleared: exact in TF32; v - tf32_hi(v) is exact in fp32."""
    return (v.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def dot_split(a, b, acc, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr):
    """acc + a @ b (fp32 tensors) to fp32 accuracy; A_EXACT / B_EXACT: that operand holds 16-bit values."""
    if A_EXACT and B_EXACT:
        acc = tl.dot(a, b, acc, input_precision="tf32")
    elif A_EXACT:
        hi = tf32_hi(b)
        acc = tl.dot(a, b - hi, tl.dot(a, hi, acc, input_precision="tf32"), input_precision="tf32")
    elif B_EXACT:
        hi = tf32_hi(a)
        acc = tl.dot(a - hi, b, tl.dot(hi, b, acc, input_precision="tf32"), input_precision="tf32")
    else:
        acc = tl.dot(a, b, acc, input_precision="tf32x3")
    return acc


@triton.jit
def dot_out(a, b, acc, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr, OUT16: tl.constexpr):
    """acc + a @ b for a product that only reaches an output: one TF32 pass when that output is
    16-bit (OUT16), else `dot_split`'s fp32 accuracy."""
    if OUT16:
        acc = tl.dot(a, b, acc, input_precision="tf32")
    else:
        acc = dot_split(a, b, acc, A_EXACT, B_EXACT)
    return acc


@triton.jit
def dot_bf16_split(a, b16, acc):
    """acc + a @ b16 for fp32 a and bf16 b16 as two bf16 products (a = hi + lo, each bf16)."""
    hi = a.to(tl.bfloat16)
    lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(lo, b16, tl.dot(hi, b16, acc))
