"""Fused-op error reporting: op registry and the check of the pinned error record."""
from __future__ import annotations

import threading

from jax_autooverlap.runtime import cuda


class CollectiveTimeoutError(RuntimeError):
  """A fused op waited longer than its timeout for a peer GPU."""


_lock = threading.Lock()
_ops: list[str] = []


def register_op(description: str) -> int:
  """A small integer naming a traced fused call, baked into its kernel."""
  with _lock:
    _ops.append(description)
    return len(_ops) - 1


def describe_op(op_id: int) -> str:
  with _lock:
    return _ops[op_id] if 0 <= op_id < len(_ops) else f"fused op #{op_id}"


def check_errors(record: "cuda.ErrorRecord | None" = None):
  """Raise CollectiveTimeoutError if a fused kernel recorded a timeout (then clear it)."""
  from jax_autooverlap.runtime.workspace import REGISTRY
  if record is None:
    record = REGISTRY.existing_error_record()
    if record is None:
      return
  code, op_id, rank, src, chunk, seen, expected, _ = record.read()
  if code == 0:
    return
  record.clear()
  if code == cuda.ERR_TIMEOUT and chunk < 0:  # kernels/split_k.py sum_own_rows
    raise CollectiveTimeoutError(
        f"{describe_op(op_id)}: rank {rank} timed out waiting for the other split-K parts of its "
        f"split tile {-1 - chunk} (counted {seen}, expected {expected}); a CTA of this kernel "
        "never stored its part. The GPU context is unusable after this error.")
  if code == cuda.ERR_TIMEOUT:
    raise CollectiveTimeoutError(
        f"{describe_op(op_id)}: rank {rank} timed out waiting for chunk {chunk} from peer rank "
        f"{src} (arrival counter {seen}, expected {expected}); the peer never sent it (did every "
        "device of the axis run the same program?). The GPU context is unusable after this error.")
  raise CollectiveTimeoutError(f"{describe_op(op_id)}: kernel error code {code}")
