"""Minimal CUDA driver access through ctypes: SM count and a pinned host error record.

The error record is host memory mapped into every device's address space
(cuMemHostAlloc PORTABLE|DEVICEMAP; with unified addressing the host pointer
is valid on the device).  A kernel whose bounded wait expires writes what it
was waiting for there and then traps; the host can still read the record
after the CUDA context is lost, so the Python error can name the op and peer.
"""
from __future__ import annotations

import ctypes
import functools

_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02

ERROR_RECORD_INTS = 8  # [code, op_id, rank, src, chunk, observed, expected, reserved]
ERR_TIMEOUT = 1


class CudaError(RuntimeError):
  pass


@functools.cache
def _lib():
  try:
    lib = ctypes.CDLL("libcuda.so.1")
  except OSError as e:
    raise CudaError(f"libcuda.so.1 (the NVIDIA driver) cannot be loaded: {e}") from e
  _check(lib.cuInit(0), "cuInit")
  return lib


def _check(rc: int, what: str):
  if rc != 0:
    raise CudaError(f"{what} failed with CUresult {rc}")


def _device(ordinal: int):
  dev = ctypes.c_int()
  _check(_lib().cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
  return dev


@functools.cache
def sm_count(ordinal: int) -> int:
  val = ctypes.c_int()
  _check(_lib().cuDeviceGetAttribute(ctypes.byref(val), _CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                     _device(ordinal)), "cuDeviceGetAttribute")
  return val.value


class ErrorRecord:
  """int32[ERROR_RECORD_INTS] of pinned, device-mapped host memory."""

  def __init__(self, ordinal: int = 0):
    lib = _lib()
    ctx = ctypes.c_void_p()
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), _device(ordinal)), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
      host = ctypes.c_void_p()
      nbytes = 4 * ERROR_RECORD_INTS
      _check(lib.cuMemHostAlloc(ctypes.byref(host), nbytes,
                                _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP),
             "cuMemHostAlloc")
      dptr = ctypes.c_uint64()
      _check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), host, 0),
             "cuMemHostGetDevicePointer")
    finally:
      _check(lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")
    self._view = (ctypes.c_int32 * ERROR_RECORD_INTS).from_address(host.value)
    ctypes.memset(host.value, 0, nbytes)
    self.device_address = int(dptr.value)

  def read(self) -> list[int]:
    return list(self._view)

  def clear(self):
    for i in range(ERROR_RECORD_INTS):
      self._view[i] = 0
