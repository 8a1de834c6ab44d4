"""Pure-JAX algorithms for the fused ops on canonical 3-D operands.

Canonical form: a batch dim B in front, rows M, contraction K, columns N.
Every function here runs on any backend.  The *ring* versions are JAX's
"collective matmul": the shard travels around the ring with `ppermute`, split
into `chunks` pieces, and each step's matmul only depends on data that has
already arrived, so XLA can overlap the next step's transfer with it.
The *unfused* versions are the plain collective + dot_general program.

Shapes (per device, n = axis size):
  ag_rows: a[B, m, K] (rows sharded), b[B, K, N]    -> out[B, n*m, N], gathered a[B, n*m, K]
  ag_k:    a[B, M, n*k], b[B, k, N] (K sharded)      -> out[B, M, N],  gathered b[B, n*k, N]
  rs_rows: a[B, M, K], b[B, K, N]                    -> out[B, M/n, N] (rows scattered, summed)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

_BMK_KN = (((2,), (1,)), ((0,), (0,)))  # [B,M,K] x [B,K,N] -> [B,M,N]


@dataclasses.dataclass(frozen=True)
class RingParams:
  """Static parameters of one fused call (hashable: used as a custom_vjp nondiff arg)."""
  axis_name: Any
  axis_size: int
  chunks: int
  precision: Any
  out_dtype: np.dtype


def _acc_dtype(dtype) -> np.dtype:
  """Partial sums are kept in f32 for low-precision floats (more exact than the unfused psum)."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return np.dtype(np.float32)
  return dtype


def _bmm(a, b, p: RingParams, dtype=None):
  return lax.dot_general(a, b, _BMK_KN, precision=p.precision,
                         preferred_element_type=p.out_dtype if dtype is None else dtype)


def _pieces(size: int, chunks: int) -> list[tuple[int, int]]:
  """(offset, length) of `chunks` nearly equal static pieces of `size`."""
  bounds = [size * i // chunks for i in range(chunks + 1)]
  return [(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def _ring_from_next(p: RingParams):
  # Every device sends to its left neighbour, so after s steps device i holds
  # the shard of device (i + s) mod n: shards arrive in increasing order.
  n = p.axis_size
  return [(j, (j - 1) % n) for j in range(n)]


def _gather_rows(blocks_by_step, axis: int, p: RingParams):
  """Concatenate blocks received at steps 0..n-1 and rotate them into shard order."""
  stacked = jnp.concatenate(blocks_by_step, axis=axis)
  shard = blocks_by_step[0].shape[axis]
  shift = lax.axis_index(p.axis_name) * shard
  return jnp.roll(stacked, shift, axis=axis)


def ag_rows_ring(a, b, p: RingParams):
  n = p.axis_size
  perm = _ring_from_next(p)
  pieces = [lax.slice_in_dim(a, lo, lo + ln, axis=1) for lo, ln in _pieces(a.shape[1], p.chunks)]
  outs, gathered = [], []
  for step in range(n):
    # Issue the next step's transfers before this step's matmuls.
    nxt = [lax.ppermute(x, p.axis_name, perm) for x in pieces] if step < n - 1 else None
    outs.append(jnp.concatenate([_bmm(x, b, p) for x in pieces], axis=1))
    gathered.append(jnp.concatenate(pieces, axis=1))
    pieces = nxt
  return _gather_rows(outs, 1, p), _gather_rows(gathered, 1, p)


def ag_k_ring(a, b, p: RingParams):
  n = p.axis_size
  k = b.shape[1]
  perm = _ring_from_next(p)
  idx = lax.axis_index(p.axis_name)
  acc_dtype = _acc_dtype(p.out_dtype)
  spans = _pieces(k, p.chunks)
  pieces = [lax.slice_in_dim(b, lo, lo + ln, axis=1) for lo, ln in spans]
  acc, gathered = None, []
  for step in range(n):
    nxt = [lax.ppermute(x, p.axis_name, perm) for x in pieces] if step < n - 1 else None
    src = (idx + step) % n
    for (lo, ln), x in zip(spans, pieces):
      a_cols = lax.dynamic_slice_in_dim(a, src * k + lo, ln, axis=2)
      part = _bmm(a_cols, x, p, acc_dtype)
      acc = part if acc is None else acc + part
    gathered.append(jnp.concatenate(pieces, axis=1))
    pieces = nxt
  return acc.astype(p.out_dtype), _gather_rows(gathered, 1, p)


def rs_rows_ring(a, b, p: RingParams):
  n = p.axis_size
  m = a.shape[1] // n
  # The accumulator of block d starts on device d+1, moves right each step and
  # ends on device d after visiting every device once.
  perm = [(j, (j + 1) % n) for j in range(n)]
  idx = lax.axis_index(p.axis_name)
  acc_dtype = _acc_dtype(p.out_dtype)
  spans = _pieces(m, p.chunks)
  accs = [None] * len(spans)
  for step in range(n):
    dst = (idx + 2 * n - 1 - step) % n
    for c, (lo, ln) in enumerate(spans):
      rows = lax.dynamic_slice_in_dim(a, dst * m + lo, ln, axis=1)
      part = _bmm(rows, b, p, acc_dtype)
      accs[c] = part if accs[c] is None else lax.ppermute(accs[c], p.axis_name, perm) + part
  return jnp.concatenate(accs, axis=1).astype(p.out_dtype)


def ag_rows_unfused(a, b, p: RingParams):
  g = lax.all_gather(a, p.axis_name, axis=1, tiled=True)
  return _bmm(g, b, p), g


def ag_k_unfused(a, b, p: RingParams):
  g = lax.all_gather(b, p.axis_name, axis=1, tiled=True)
  return _bmm(a, g, p), g


def rs_rows_unfused(a, b, p: RingParams):
  return lax.psum_scatter(_bmm(a, b, p), p.axis_name, scatter_dimension=1, tiled=True)
