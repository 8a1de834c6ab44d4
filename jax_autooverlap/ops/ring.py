"""The chunked ppermute ring both fused ops' references run (JAX's "collective matmul").

Canonical form: a batch dim B in front, rows M, contraction K, columns N.  The
shard travels around the ring with `ppermute`, split into `chunks` pieces, and
each step's matmul only depends on data that has already arrived, so XLA can
overlap the next step's transfer with it.  Runs on any backend.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

BMK_KN = (((2,), (1,)), ((0,), (0,)))  # [B,M,K] x [B,K,N] -> [B,M,N]


@dataclasses.dataclass(frozen=True)
class RingParams:
  """Static parameters of one fused call (hashable: used as a custom_vjp nondiff arg)."""
  axis_name: Any
  axis_size: int
  chunks: int
  precision: Any
  out_dtype: np.dtype


def acc_dtype(dtype) -> np.dtype:
  """Partial sums are kept in f32 for low-precision floats (more exact than the unfused psum)."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return np.dtype(np.float32)
  return dtype


def bmm(a, b, p: RingParams, dtype=None, scale=None):
  """[B, M, K] x [B, K, N] -> [B, M, N] in p.out_dtype (or dtype).

  scale (fp8 operands: the product of the per-tensor scales, f32[]): the product is taken in
  f32 and scaled before the cast, as the GPU kernels' epilogues do."""
  out_dtype = p.out_dtype if dtype is None else dtype
  if scale is None:
    return lax.dot_general(a, b, BMK_KN, precision=p.precision,
                           preferred_element_type=out_dtype)
  prod = lax.dot_general(a, b, BMK_KN, precision=p.precision,
                         preferred_element_type=np.float32)
  return (prod * scale).astype(out_dtype)


def pieces(size: int, chunks: int) -> list[tuple[int, int]]:
  """(offset, length) of `chunks` nearly equal static pieces of `size`."""
  bounds = [size * i // chunks for i in range(chunks + 1)]
  return [(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def from_next(p: RingParams):
  """ppermute pairs: every device sends to its left neighbour, so after s steps device i holds
  the shard of device (i + s) mod n: shards arrive in increasing order."""
  n = p.axis_size
  return [(j, (j - 1) % n) for j in range(n)]


def gather_rows(blocks_by_step, axis: int, p: RingParams):
  """Concatenate blocks received at steps 0..n-1 (from_next order) and rotate them into shard
  order."""
  stacked = jnp.concatenate(blocks_by_step, axis=axis)
  shard = blocks_by_step[0].shape[axis]
  shift = lax.axis_index(p.axis_name) * shard
  return jnp.roll(stacked, shift, axis=axis)
