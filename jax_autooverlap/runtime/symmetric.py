"""Symmetric memory: one allocation per device of a mesh, at the same address in every process.

Layout seen by every process of the mesh: one virtual address range
[base, base + n * stride) reserved at the *same* base in every process, slot
i holding the allocation of the mesh's i-th device (flat order) wherever
that device is on this host, and left unmapped otherwise.  So device i's
memory is at base + i * stride in every process: the kernels' address
tables are the same constants everywhere and every process compiles the
same program, as multi-process JAX expects (e.g. XLA's sharded autotuning
and jax's compile-once-share-binary option key on the program).

`SymmetricAllocator` is the small interface the workspace registry uses; the
one backend is `CuMemAllocator` (CUDA virtual memory management, POSIX file
descriptors passed over a Unix socket between processes of one host; one
process driving several GPUs uses the same path without descriptors).  A
backend on NCCL windows (ncclMemAlloc + ncclCommWindowRegister, NCCL >= 2.29)
would have to provide the same guarantee: map the peers' memory into a range
at an agreed address, since peer pointers differ between processes.

Every step runs inside a rendezvous Session, so all processes of the mesh
reach the same outcome: a SymmetricMemory everywhere, or SetupError with the
same reason everywhere (and nothing left allocated).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

from jax_autooverlap.runtime import fdshare
from jax_autooverlap.runtime.rendezvous import Session

VA_ROUNDS = 6  # tries to find one virtual address range free in every process


class SetupError(RuntimeError):
  """Symmetric memory could not be set up; every process of the session got the same reason."""


@dataclasses.dataclass(frozen=True)
class Slot:
  """A device of the mesh (flat order): its process, host and local CUDA ordinal."""
  process: int
  host: str
  ordinal: int | None  # None for devices of other processes


@dataclasses.dataclass
class SymmetricMemory:
  """Device i's memory is at base + i * stride (mapped where device i is on this host)."""
  base: int
  stride: int
  slots: int
  _release: Callable[[], None] = dataclasses.field(repr=False, default=lambda: None)

  def addresses(self) -> tuple[int, ...]:
    return tuple(self.base + i * self.stride for i in range(self.slots))

  def release(self):
    release, self._release = self._release, (lambda: None)
    release()


class SymmetricAllocator:
  """Interface: collectively allocate `nbytes` per device of a mesh, symmetric addresses."""

  name = "?"

  def allocate(self, session: Session, slots: Sequence[Slot], me: int, nbytes: int,
               init: Callable[[int, int], None]) -> SymmetricMemory:
    """Called by every process of the mesh with the same session and slots.

    `init(address, ordinal)` runs once on each of this process's own
    allocations after it has been zeroed and before any peer may use it.
    Raises SetupError (the same in every process) on failure.
    """
    raise NotImplementedError

  def close(self):
    """Stop whatever serves peers (at exit, after every allocation was released)."""


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


class CuMemAllocator(SymmetricAllocator):
  """cuMemCreate per local device; FDs to same-host processes; one symmetric VA range."""

  name = "CUDA VMM (cuMemCreate/cuMemMap), POSIX file descriptors over Unix sockets"

  def __init__(self, driver=None):
    if driver is None:
      from jax_autooverlap.runtime import cuda as driver
    self._driver = driver
    self._server: fdshare.HandleServer | None = None

  def _handle_server(self) -> fdshare.HandleServer:
    if self._server is None:
      self._server = fdshare.HandleServer()
    return self._server

  def close(self):
    if self._server is not None:
      self._server.close()
      self._server = None

  def allocate(self, session, slots, me, nbytes, init):
    drv = self._driver
    local = [(i, s.ordinal) for i, s in enumerate(slots) if s.process == me]
    my_host = next(s.host for s in slots if s.process == me)
    peers = [i for i, s in enumerate(slots) if s.process != me and s.host == my_host]
    share = bool(peers)  # other processes of this host map our memory
    ordinals = sorted({o for _, o in local})
    state = _Pieces(drv)
    offered = []
    ok, reason = True, ""
    try:
      drv.check_vmm(ordinals[0], share)
      gran = drv.granularity(ordinals[0], share)
      contact = {"need": int(nbytes), "gran": gran}
      if share:
        server = self._handle_server()
        contact.update(server=server.address, secret=server.secret)
      info = session.exchange("size", contact)
      align = max(v["gran"] for v in info.values())
      state.stride = _round_up(max(v["need"] for v in info.values()), align)
      state.total = state.stride * len(slots)
      own = []
      for slot, ordinal in local:
        handle = drv.mem_create(ordinal, state.stride, share)
        state.handles.append(handle)
        own.append((slot, ordinal, handle))
        if share:
          fd = drv.export_fd(handle)
          try:
            key = f"{session.tag}/{slot}"
            self._handle_server().offer(key, fd)
            offered.append(key)
          finally:
            os.close(fd)
      state.base = self._agree_va(session, state, align)
      for slot, ordinal, handle in own:
        addr = state.map(slot, handle, ordinals)
        drv.memset_zero(ordinal, addr, state.stride)
        init(addr, ordinal)
      for slot in peers:  # every peer offered before the address agreement above
        p = slots[slot].process
        fd = fdshare.fetch(info[p]["server"], info[p]["secret"], f"{session.tag}/{slot}",
                           session.timeout_s)
        try:
          handle = drv.import_fd(fd)
        finally:
          os.close(fd)
        state.handles.append(handle)
        state.map(slot, handle, ordinals)
    except Exception as e:  # noqa: BLE001 (any failure becomes this process's vote)
      ok, reason = False, f"{type(e).__name__}: {e}"
    decision = session.decide(ok, reason)
    for key in offered:  # peers have imported (or given up) by the time of the decision
      self._handle_server().withdraw(key)
    if not decision.ok:
      state.release()
      raise SetupError(decision.reason)
    return SymmetricMemory(state.base, state.stride, len(slots), state.release)

  def _agree_va(self, session, state: "_Pieces", align: int) -> int:
    """A base address that every process reserved: each round, every process reserves a range
    anywhere, and all ask for `candidate(...)` of what was reserved by hint."""
    drv = self._driver
    for r in range(VA_ROUNDS):
      mine = drv.address_reserve(state.total, align, 0)
      state.ranges.append(mine)
      cand = candidate(r, session.exchange(f"va{r}", mine).values(), state.total, align)
      got = cand in state.ranges
      if not got:
        try:
          hinted = drv.address_reserve(state.total, align, cand)
        except Exception:  # noqa: BLE001 (the driver may refuse the hint outright)
          hinted = None
        if hinted is not None:
          state.ranges.append(hinted)
          got = hinted == cand
      if all(session.exchange(f"va{r}-ok", got).values()):
        for other in [x for x in state.ranges if x != cand]:
          drv.address_free(other, state.total)
        state.ranges = [cand]
        return cand
    raise SetupError(f"no virtual address range of {state.total} bytes was free at the same "
                     f"address in every process after {VA_ROUNDS} tries")


VA_GAP = 1 << 32  # how far above every process's reservations later rounds ask
# The CUDA driver (580, H200) honours an address hint only at this alignment: it rounds other
# hints up (seen: each hint came back 24 MiB above, at the next 32 MiB boundary).
VA_HINT_ALIGN = 1 << 25


def candidate(round_: int, reserved, total: int, align: int) -> int:
  """The address every process asks for in a round, at the alignment the driver honours: the
  highest range the processes just reserved, then, as rounds fail, further above all of them
  (ranges high above every process's reservations are free in every process more often than
  one that another process happens to hold)."""
  step = max(align, VA_HINT_ALIGN)
  top = max(reserved) + (0 if round_ == 0 else total + (2 ** round_ - 1) * VA_GAP)
  return -(-top // step) * step


class _Pieces:
  """What one allocation holds so far; release() undoes whatever was done."""

  def __init__(self, driver):
    self.drv = driver
    self.handles: list[int] = []
    self.ranges: list[int] = []  # reserved virtual ranges of `total` bytes
    self.mapped: list[int] = []  # mapped slot addresses
    self.stride = self.total = 0
    self.base = None

  def map(self, slot: int, handle: int, ordinals) -> int:
    addr = self.base + slot * self.stride
    self.drv.mem_map(addr, self.stride, handle)
    self.mapped.append(addr)
    self.drv.set_access(addr, self.stride, ordinals)
    return addr

  def release(self):
    """Best effort (also at exit, possibly after the context was lost): keep going on errors."""
    for fn, args in ([(self.drv.mem_unmap, (a, self.stride)) for a in self.mapped]
                     + [(self.drv.mem_release, (h,)) for h in self.handles]
                     + [(self.drv.address_free, (r, self.total)) for r in self.ranges]):
      try:
        fn(*args)
      except Exception:  # noqa: BLE001
        pass
    self.mapped, self.handles, self.ranges = [], [], []
