"""The fp8 formats the fused ops take, and the error a fused fp8 matmul may carry.

Hopper's fp8 tensor cores multiply float8_e4m3fn (4 exponent, 3 mantissa bits: forward
activations and weights) and float8_e5m2 (5 exponent, 2 mantissa bits: gradients) in any
pairing, accumulating in f32.  A fused fp8 op computes

    out = (a_fp8 @ b_fp8 accumulated in f32) * scale_a * scale_b,  cast to bf16 or f32

with per-tensor scales (real value = fp8 value * scale).  Its reference is the f32 product of
the dequantized operands (exact: an fp8 x fp8 product has at most 8 significant bits).
`gemm_tolerance` bounds how far a computed result may be from it; `quantization_error` is the
error the fp8 formats themselves put into every product term, which the bound stays well
below: a fused fp8 op that meets it is as exact as an fp8 matmul can be.
"""
from __future__ import annotations

import math

import numpy as np

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# Output dtypes of the fused fp8 ops (the kernels' epilogues; XLA's fp8 GEMM gives the same).
FP8_OUT_DTYPES = ("bfloat16", "float32")
MANTISSA_BITS = {"float8_e4m3fn": 3, "float8_e5m2": 2, "bfloat16": 7, "float16": 10,
                 "float32": 23}
# Bits of the running sum Hopper's fp8 tensor cores keep between their k-steps (the
# accumulator is f32, but each wgmma adds its 32 products at about 14 bits: DeepSeek-V3's
# report, section 3.3.2, measured on H800; we assume one bit less).
FP8_ACCUMULATION_BITS = 13
WGMMA_K = 32  # products one fp8 wgmma adds into the accumulator per step


def name(dtype) -> str:
  return np.dtype(dtype).name


def short(dtype) -> str:
  """e4m3 / e5m2 for the fp8 formats (as PTX names them), the dtype's name otherwise."""
  return {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}.get(name(dtype), name(dtype))


def is_fp8(dtype) -> bool:
  return dtype is not None and name(dtype) in FP8_DTYPES


def unit_roundoff(dtype) -> float:
  """Half an ulp at 1 (round to nearest): 2**-(mantissa bits + 1)."""
  return 2.0 ** -(MANTISSA_BITS[name(dtype)] + 1)


def quantization_error(a_dtype, b_dtype) -> float:
  """Relative error (first order) rounding both operands to their fp8 formats puts into one
  product term: e4m3 x e4m3 0.125, e4m3 x e5m2 0.1875.  The scale of "fp8 error"."""
  return unit_roundoff(a_dtype) + unit_roundoff(b_dtype)


def gemm_tolerance(k: int, out_dtype, partials: int = 1) -> float:
  """Normwise relative error (||got - want|| / ||want||) a computed fp8 matmul may have against
  the f32 product of its dequantized operands, contraction k:

  - accumulation: k / WGMMA_K tensor-core steps, each rounding the running sum to
    FP8_ACCUMULATION_BITS (worst case, errors of one sign): (k / 32) * 2**-13;
  - rounding to the output dtype, once per partial product a reduce-scatter sums (each is
    rounded before it is pushed) and once for the result: (partials + 1) * u(out).

  k = 8192 into bf16 (AG+GEMM): 0.039; the formats' own error is 0.125 or more.
  """
  accumulate = math.ceil(k / WGMMA_K) * 2.0 ** -FP8_ACCUMULATION_BITS
  return accumulate + (partials + 1) * unit_roundoff(out_dtype)
