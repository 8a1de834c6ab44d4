"""Symmetric workspace: one device buffer per GPU of a mesh, reachable by its peers.

Each GPU's workspace holds (byte offsets):
  0                  epoch: calls completed on this GPU (int32)
  4                  done: CTAs of the running call that finished (int32)
  8                  tile counters int32[2 parity]: next output tile to hand out
  FLAGS_OFFSET       arrival counters int32[2 parity][world][MAX_CHUNKS]
  buffer_offset(w)   gather buffers [2 parity][world][rows x cols] elements

Invariants the kernels rely on:
- Every GPU of a group runs the same sequence of fused calls (SPMD), so the
  epochs of all GPUs advance in lockstep and parity = epoch % 2 agrees.
- A call writes a peer's parity slot p only after it finished its previous
  call, which needed that peer's data of the previous call, which the peer
  sent only after finishing the call before: so slot p of the peer is no
  longer read.  Counters of slot p are zeroed by the last CTA of each call.
- The buffers are allocated once per device set and only grow; a grown set
  is new memory (epochs start at 0 everywhere) and old sets stay alive, since
  programs compiled earlier hold their addresses as constants.
"""
from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp

from jax_autooverlap.runtime import cuda

FLAGS_OFFSET = 256
MAX_CHUNKS = 64
_ALIGN = 1024


def flags_bytes(world: int) -> int:
  return 2 * world * MAX_CHUNKS * 4


def buffer_offset(world: int) -> int:
  return -(-(FLAGS_OFFSET + flags_bytes(world)) // _ALIGN) * _ALIGN


def required_bytes(world: int, shard_bytes: int) -> int:
  return buffer_offset(world) + 2 * world * shard_bytes


@dataclasses.dataclass(frozen=True)
class _Allocation:
  arrays: tuple  # one uint8 jax.Array per device, kept alive
  nbytes: int

  @property
  def addresses(self) -> tuple[int, ...]:
    return tuple(a.unsafe_buffer_pointer() for a in self.arrays)


class WorkspaceRegistry:
  """Workspaces keyed by the ordered tuple of devices of a mesh; grown on demand."""

  def __init__(self):
    self._lock = threading.Lock()
    self._current: dict[tuple, _Allocation] = {}
    self._retired: list[_Allocation] = []  # still referenced by compiled programs
    self._error_record: cuda.ErrorRecord | None = None

  def addresses(self, devices: tuple, nbytes: int) -> tuple[int, ...]:
    """Base address of a workspace of at least nbytes on each device (same order)."""
    key = tuple(d.id for d in devices)
    with self._lock:
      cur = self._current.get(key)
      if cur is None or cur.nbytes < nbytes:
        size = max(nbytes, 2 * cur.nbytes if cur else 0)
        with jax.ensure_compile_time_eval():  # we are usually inside a jit trace
          arrays = tuple(jnp.zeros((size,), jnp.uint8, device=d) for d in devices)
          jax.block_until_ready(arrays)
        if cur is not None:
          self._retired.append(cur)
        cur = self._current[key] = _Allocation(arrays, size)
      return cur.addresses

  def existing_error_record(self) -> cuda.ErrorRecord | None:
    return self._error_record

  def error_record(self) -> cuda.ErrorRecord:
    with self._lock:
      if self._error_record is None:
        self._error_record = cuda.ErrorRecord()
      return self._error_record


REGISTRY = WorkspaceRegistry()
