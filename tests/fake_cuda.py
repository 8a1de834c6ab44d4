"""A stand-in for runtime/cuda.py's driver functions, for CPU tests of the symmetric workspace.

Physical allocations are memfd files (so exporting, passing and importing a
handle between processes is real: the descriptor travels over the Unix
socket and both processes see the same bytes); "device" virtual addresses
are simulated per process, starting at a per-process base so that two
processes do not get the same addresses by accident; a reservation at a free
hinted address is honoured, as the CUDA driver does.  Mapped memory is a
host mmap of the memfd, readable with `read` to check contents.
"""
import mmap
import os

import numpy as np
from types import SimpleNamespace


class FakeCudaError(RuntimeError):
  pass


class FakeDriver:
  GRANULARITY = 1 << 16

  HINT_ALIGN = 1 << 25  # like the real driver: a hint counts at this alignment, rounded up

  def __init__(self, va_start: int | None = None, sms: int = 132, vmm: bool = True,
               honour_hints: bool = True, memory: int = 1 << 40):
    self.va_start = va_start if va_start is not None else \
        0x7F00_0000_0000 + (os.getpid() % 251) * (1 << 32)
    self.sms, self.vmm, self.honour_hints, self.memory = sms, vmm, honour_hints, memory
    self.reserved: dict[int, int] = {}  # address -> size
    self.mapped: dict[int, mmap.mmap] = {}  # address -> mapping
    self.access: dict[int, tuple] = {}
    self.zeroed: set[int] = set()
    self.handles: dict[int, int] = {}  # handle -> memfd
    self._next = 1
    self.records = {}

  # -- the driver interface ----------------------------------------------------
  def sm_count(self, ordinal):
    return self.sms

  def check_vmm(self, ordinal, shareable):
    if not self.vmm:
      raise FakeCudaError(f"device {ordinal} does not support CUDA virtual memory management")

  def granularity(self, ordinal, shareable):
    return self.GRANULARITY

  def mem_create(self, ordinal, nbytes, shareable):
    if nbytes > self.memory:
      raise FakeCudaError(f"cuMemCreate({nbytes} bytes on device {ordinal}) failed with "
                          "CUresult 2 (out of memory)")
    fd = os.memfd_create(f"fake-cumem-dev{ordinal}")
    os.ftruncate(fd, nbytes)
    return self._new_handle(fd)

  def _new_handle(self, fd):
    h, self._next = self._next, self._next + 1
    self.handles[h] = fd
    return h

  def mem_release(self, handle):
    os.close(self.handles.pop(handle))

  def export_fd(self, handle):
    return os.dup(self.handles[handle])

  def import_fd(self, fd):
    return self._new_handle(os.dup(fd))

  def address_reserve(self, nbytes, alignment, hint=0):
    hint = -(-hint // self.HINT_ALIGN) * self.HINT_ALIGN
    if hint and self.honour_hints and self._free(hint, nbytes):
      addr = hint
    else:
      addr = self.va_start
      while not self._free(addr, nbytes):
        addr = max(a + n for a, n in self.reserved.items() if a + n > addr)
        addr = -(-addr // alignment) * alignment
    self.reserved[addr] = nbytes
    return addr

  def _free(self, addr, nbytes):
    return all(addr + nbytes <= a or a + n <= addr for a, n in self.reserved.items())

  def address_free(self, address, nbytes):
    assert self.reserved.pop(address) == nbytes

  def mem_map(self, address, nbytes, handle):
    assert any(a <= address and address + nbytes <= a + n for a, n in self.reserved.items()), \
        "mapping outside a reserved range"
    self.mapped[address] = mmap.mmap(self.handles[handle], nbytes)

  def mem_unmap(self, address, nbytes):
    self.mapped.pop(address).close()
    self.access.pop(address, None)

  def set_access(self, address, nbytes, ordinals):
    assert address in self.mapped
    self.access[address] = tuple(ordinals)

  def memset_zero(self, ordinal, address, nbytes):
    # The allocator zeroes whole fresh allocations; a new memfd reads as zeros already, so
    # only record the request (writing gigabytes of zeros would cost real memory).
    base, mm = self._mapping(address)
    assert (base, len(mm)) == (address, nbytes), "zeroing only part of an allocation"
    self.zeroed.add(address)

  def write(self, ordinal, address, data):
    base, mm = self._mapping(address)
    mm[address - base:address - base + len(data)] = data

  def synchronize(self, ordinal):
    pass

  def error_record(self, ordinal):
    return SimpleNamespace(device_address=0xE000_0000 + os.getpid(), read=lambda: [0] * 8,
                           clear=lambda: None)

  # -- for tests ---------------------------------------------------------------
  def _mapping(self, address):
    for base, mm in self.mapped.items():
      if base <= address < base + len(mm):
        return base, mm
    raise FakeCudaError(f"address {address:#x} is not mapped")

  def read(self, address, nbytes) -> bytes:
    base, mm = self._mapping(address)
    return bytes(mm[address - base:address - base + nbytes])

  def live(self) -> dict:
    """What is still allocated (all zero after the registry released everything)."""
    return {"handles": len(self.handles), "reserved": len(self.reserved),
            "mapped": len(self.mapped)}


class FakeGpu:
  """A stand-in GPU device for planning tests (what plan() and the workspace read of one)."""
  platform = "gpu"
  device_kind = "NVIDIA H200"
  process_index = 0

  def __init__(self, i):
    self.id = self.local_hardware_id = i


def fake_gpu_mesh(n: int = 2):
  """A stand-in one-axis ("x") mesh of n FakeGpus."""
  return SimpleNamespace(devices=np.array([FakeGpu(i) for i in range(n)]), axis_names=("x",),
                         shape={"x": n})
