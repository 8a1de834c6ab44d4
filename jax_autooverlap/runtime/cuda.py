"""Minimal CUDA driver access through ctypes: SM count, a pinned host error record and the
virtual memory management calls (cuMem*) of the symmetric workspace.

The error record is host memory mapped into every device's address space
(cuMemHostAlloc PORTABLE|DEVICEMAP; with unified addressing the host pointer
is valid on the device).  A kernel whose bounded wait expires writes what it
was waiting for there and then traps; the host can still read the record
after the CUDA context is lost, so the Python error can name the op and peer.

libcuda is loaded on first use, so importing this module works without a GPU.
The module-level functions below are the "driver" that runtime/symmetric.py
calls (tests substitute a stand-in object with the same functions).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools

_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
_CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13               # kHz, the SM boost clock
_CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36        # kHz
_CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37  # bits
_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02
_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_HANDLE_TYPE_NONE = 0
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1

ERROR_RECORD_INTS = 8  # [code, op_id, rank, src, chunk, observed, expected, reserved]
ERR_TIMEOUT = 1


class CudaError(RuntimeError):
  pass


class _MemLocation(ctypes.Structure):
  _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp (v1)
  _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
              ("location", _MemLocation), ("win32HandleMetaData", ctypes.c_void_p),
              ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
              ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
  _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


_u64, _size = ctypes.c_uint64, ctypes.c_size_t
_SIGNATURES = {  # 64-bit arguments must be declared, ctypes passes plain ints as C int
    "cuMemGetAllocationGranularity": [ctypes.POINTER(_size), ctypes.POINTER(_AllocationProp),
                                      ctypes.c_int],
    "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_AllocationProp), _u64],
    "cuMemRelease": [_u64],
    "cuMemExportToShareableHandle": [ctypes.c_void_p, _u64, ctypes.c_int, _u64],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
    "cuMemAddressFree": [_u64, _size],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemUnmap": [_u64, _size],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
    "cuMemsetD8_v2": [_u64, ctypes.c_ubyte, _size],
    "cuMemcpyHtoD_v2": [_u64, ctypes.c_void_p, _size],
}


@functools.cache
def _lib():
  try:
    lib = ctypes.CDLL("libcuda.so.1")
  except OSError as e:
    raise CudaError(f"libcuda.so.1 (the NVIDIA driver) cannot be loaded: {e}") from e
  _check(lib.cuInit(0), "cuInit")
  for name, argtypes in _SIGNATURES.items():
    getattr(lib, name).argtypes = argtypes
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


@functools.cache
def device_uuid(ordinal: int) -> str:
  """The GPU's UUID (the same in every process that sees this GPU, whatever its ordinal there)."""
  raw = (ctypes.c_ubyte * 16)()
  _check(_lib().cuDeviceGetUuid(ctypes.byref(raw), _device(ordinal)), "cuDeviceGetUuid")
  return bytes(raw).hex()


@functools.cache
def device_properties(ordinal: int) -> dict:
  """SMs, SM boost clock (MHz) and memory bandwidth (GB/s: double data rate x bus width) as the
  driver reports them."""
  a = lambda attribute: _attribute(ordinal, attribute)
  return {"num_sms": a(_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
          "clock_mhz": a(_CU_DEVICE_ATTRIBUTE_CLOCK_RATE) / 1e3,
          "memory_gbps": 2 * a(_CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE) * 1e3
          * a(_CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH) / 8 / 1e9}


@functools.cache
def _primary_context(ordinal: int):
  ctx = ctypes.c_void_p()
  _check(_lib().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), _device(ordinal)),
         "cuDevicePrimaryCtxRetain")
  return ctx


@contextlib.contextmanager
def _current(ordinal: int):
  """The device's primary context (the one XLA uses) made current around driver calls."""
  lib = _lib()
  _check(lib.cuCtxPushCurrent_v2(_primary_context(ordinal)), "cuCtxPushCurrent")
  try:
    yield lib
  finally:
    _check(lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")


# --- virtual memory management (the symmetric workspace's driver) -----------

def _prop(ordinal: int, shareable: bool) -> _AllocationProp:
  prop = _AllocationProp()
  prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
  prop.requestedHandleTypes = (_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if shareable
                               else _CU_MEM_HANDLE_TYPE_NONE)
  prop.location = _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
  return prop


def _attribute(ordinal: int, attribute: int) -> int:
  val = ctypes.c_int()
  _check(_lib().cuDeviceGetAttribute(ctypes.byref(val), attribute, _device(ordinal)),
         "cuDeviceGetAttribute")
  return val.value


def check_vmm(ordinal: int, shareable: bool):
  """Raise CudaError unless the device supports cuMem* (and POSIX-FD export if shareable)."""
  if not _attribute(ordinal, _CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED):
    raise CudaError(f"device {ordinal} does not support CUDA virtual memory management")
  if shareable and not _attribute(ordinal,
                                  _CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED):
    raise CudaError(f"device {ordinal} cannot export memory as POSIX file descriptors")


def granularity(ordinal: int, shareable: bool) -> int:
  gran = _size()
  _check(_lib().cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(_prop(
      ordinal, shareable)), _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity")
  return int(gran.value)


def mem_create(ordinal: int, nbytes: int, shareable: bool) -> int:
  """Physical memory on the device (a generic allocation handle)."""
  handle = _u64()
  with _current(ordinal) as lib:
    _check(lib.cuMemCreate(ctypes.byref(handle), nbytes, ctypes.byref(_prop(ordinal, shareable)),
                           0), f"cuMemCreate({nbytes} bytes on device {ordinal})")
  return int(handle.value)


def mem_release(handle: int):
  _check(_lib().cuMemRelease(handle), "cuMemRelease")


def export_fd(handle: int) -> int:
  fd = ctypes.c_int(-1)
  _check(_lib().cuMemExportToShareableHandle(ctypes.byref(fd), handle,
                                             _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
         "cuMemExportToShareableHandle")
  return fd.value


def import_fd(fd: int) -> int:
  handle = _u64()
  # For POSIX file descriptors the "OS handle" argument is the descriptor's value itself.
  _check(_lib().cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                               _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
         "cuMemImportFromShareableHandle")
  return int(handle.value)


def address_reserve(nbytes: int, alignment: int, hint: int = 0) -> int:
  """A virtual address range; `hint` is where the driver should try to place it."""
  ptr = _u64()
  _check(_lib().cuMemAddressReserve(ctypes.byref(ptr), nbytes, alignment, hint, 0),
         f"cuMemAddressReserve({nbytes} bytes)")
  return int(ptr.value)


def address_free(address: int, nbytes: int):
  _check(_lib().cuMemAddressFree(address, nbytes), "cuMemAddressFree")


def mem_map(address: int, nbytes: int, handle: int):
  _check(_lib().cuMemMap(address, nbytes, 0, handle, 0), "cuMemMap")


def mem_unmap(address: int, nbytes: int):
  _check(_lib().cuMemUnmap(address, nbytes), "cuMemUnmap")


def set_access(address: int, nbytes: int, ordinals):
  """Read-write access to a mapped range for each device of `ordinals`."""
  descs = (_AccessDesc * len(ordinals))(*[
      _AccessDesc(_MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, o), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      for o in ordinals])
  _check(_lib().cuMemSetAccess(address, nbytes, descs, len(ordinals)),
         f"cuMemSetAccess(devices {list(ordinals)})")


# memset and memcpy run on the legacy default stream; waiting for that stream (not the
# whole context) leaves XLA's streams alone.
def memset_zero(ordinal: int, address: int, nbytes: int):
  """Zero device memory and wait until it is done."""
  with _current(ordinal) as lib:
    _check(lib.cuMemsetD8_v2(address, 0, nbytes), "cuMemsetD8")
    _check(lib.cuStreamSynchronize(None), "cuStreamSynchronize")


def write(ordinal: int, address: int, data: bytes):
  """Copy host bytes to device memory and wait until it is done."""
  buf = ctypes.create_string_buffer(data, len(data))
  with _current(ordinal) as lib:
    _check(lib.cuMemcpyHtoD_v2(address, buf, len(data)), "cuMemcpyHtoD")
    _check(lib.cuStreamSynchronize(None), "cuStreamSynchronize")


def synchronize(ordinal: int):
  with _current(ordinal) as lib:
    _check(lib.cuCtxSynchronize(), "cuCtxSynchronize")


def error_record(ordinal: int) -> "ErrorRecord":
  return ErrorRecord(ordinal)


class ErrorRecord:
  """int32[ERROR_RECORD_INTS] of pinned, device-mapped host memory."""

  def __init__(self, ordinal: int = 0):
    nbytes = 4 * ERROR_RECORD_INTS
    host, dptr = ctypes.c_void_p(), ctypes.c_uint64()
    with _current(ordinal) as lib:
      _check(lib.cuMemHostAlloc(ctypes.byref(host), nbytes,
                                _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP),
             "cuMemHostAlloc")
      _check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), host, 0),
             "cuMemHostGetDevicePointer")
    self._view = (ctypes.c_int32 * ERROR_RECORD_INTS).from_address(host.value)
    ctypes.memset(host.value, 0, nbytes)
    self.device_address = int(dptr.value)

  def read(self) -> list[int]:
    return list(self._view)

  def clear(self):
    for i in range(ERROR_RECORD_INTS):
      self._view[i] = 0
