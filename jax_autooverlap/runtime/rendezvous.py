"""Rendezvous of the processes of a mesh at trace time, over jax.distributed's key-value store.

Planning runs at trace time in every process, and every process traces the
same program, so every process reaches the same set-up steps in the same
order.  A `Session` is one such step among a fixed set of processes, named
by a tag that all of them derive the same way (e.g. a device set and a
growth counter).  `exchange` publishes this process's payload and waits,
bounded, for every peer's; `decide` turns local success or failure into one
decision shared by all: the first decision written to the store wins (the
store refuses to overwrite a key), so a process that fails, times out or
arrives late ends up with the same answer as everyone else; never a mixed
choice, never an unbounded wait.

Without jax.distributed (or when the processes are just this one) a session
is in-process: exchanges return this process's payload, decisions are local.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import Any, Sequence

PREFIX = "jax_autooverlap"
_POLL_S = 0.1  # slice of a blocking wait between checks for a decision


def default_timeout_s() -> float:
  return float(os.environ.get("JAX_AUTOOVERLAP_RENDEZVOUS_TIMEOUT_S", "120"))


class RendezvousTimeout(RuntimeError):
  """Some processes did not reach a set-up step in time."""


class SetupAborted(RuntimeError):
  """Another process already decided the session (it failed); this one stops waiting."""


@dataclasses.dataclass(frozen=True)
class Decision:
  ok: bool
  reason: str = ""


def client():
  """The jax.distributed client, or None when jax.distributed is not initialised."""
  from jax._src import distributed
  return distributed.global_state.client


def process_index() -> int:
  from jax._src import distributed
  state = distributed.global_state
  return int(state.process_id) if state.client is not None else 0


def host_id() -> str:
  """This machine's identity: processes with equal ids can share memory through file
  descriptors (host name + kernel boot id, so containers on one machine count as
  different hosts unless they share the host name).

  Not taken from the devices: in jax 0.11 multi-process CPU runs every device has
  slice_index 0 whatever its host (checked), and on GPUs a slice may be an NVLink
  domain spanning hosts, where descriptors cannot travel.
  """
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
  except OSError:
    boot = "?"
  return f"{socket.gethostname()}/{boot}"


def _is(err: Exception, code: str) -> bool:
  return code in str(err)


class Session:
  """One collective set-up step among `processes` (process indices), keyed by `tag`.

  `what` names the step in errors (e.g. "workspace of devices [0, 1], growth 2").
  """

  def __init__(self, tag: str, processes: Sequence[int], what: str,
               timeout_s: float | None = None, kv=None, me: int | None = None):
    self.processes = tuple(sorted(set(int(p) for p in processes)))
    self.me = process_index() if me is None else me
    if self.me not in self.processes:
      raise ValueError(f"{what}: process {self.me} is not one of the session's processes "
                       f"{list(self.processes)}")
    self.what = what
    self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
    self._kv = (client() if kv is None else kv) if len(self.processes) > 1 else None
    if len(self.processes) > 1 and self._kv is None:
      raise RuntimeError(f"{what}: processes {list(self.processes)} need jax.distributed "
                         "(not initialised)")
    self.tag = tag
    self._key = f"{PREFIX}/{tag}"

  @property
  def in_process(self) -> bool:
    return self._kv is None

  def exchange(self, step: str, payload: Any) -> dict[int, Any]:
    """Publish a JSON-able payload and return every process's, by process index.

    Raises RendezvousTimeout naming the missing processes, or SetupAborted if
    another process decided the session meanwhile.
    """
    if self.in_process:
      return {self.me: payload}
    self._kv.key_value_set_bytes(f"{self._key}/{step}/{self.me}", json.dumps(payload).encode())
    return self._collect(step)

  def _collect(self, step: str) -> dict[int, Any]:
    deadline = time.monotonic() + self.timeout_s
    got = {}
    for p in self.processes:
      key = f"{self._key}/{step}/{p}"
      while p not in got:
        left = deadline - time.monotonic()
        if left <= 0:
          missing = [q for q in self.processes if q not in got and not self._present(
              f"{self._key}/{step}/{q}")]
          raise RendezvousTimeout(
              f"{self.what}: timed out after {self.timeout_s:g} s at step {step!r} waiting for "
              f"process(es) {missing} of {list(self.processes)} (did every process trace the "
              "same program?)")
        try:
          got[p] = json.loads(self._kv.blocking_key_value_get_bytes(
              key, max(1, int(1000 * min(left, _POLL_S)))))
        except Exception as e:  # noqa: BLE001 (the client raises one error type for all)
          if not _is(e, "DEADLINE_EXCEEDED"):
            raise
          if self._present(f"{self._key}/decision"):
            raise SetupAborted(f"{self.what}: another process decided first") from None
    return got

  def _present(self, key: str) -> bool:
    try:
      self._kv.key_value_try_get_bytes(key)
      return True
    except Exception as e:  # noqa: BLE001
      if _is(e, "NOT_FOUND"):
        return False
      raise

  def decide(self, ok: bool, reason: str = "") -> Decision:
    """The session's decision, the same in every process: ok only if every process
    reported ok in time; otherwise the reason of the first failure recorded."""
    if self.in_process:
      return Decision(ok, "" if ok else f"process {self.me}: {reason}")
    proposal = None
    if ok:
      try:
        votes = self.exchange("vote", {"ok": True, "reason": ""})
        bad = [f"process {p}: {v['reason']}" for p, v in sorted(votes.items()) if not v["ok"]]
        proposal = Decision(not bad, "; ".join(bad))
      except RendezvousTimeout as e:
        proposal = Decision(False, str(e))
      except SetupAborted:
        pass
    else:
      self._kv.key_value_set_bytes(f"{self._key}/vote/{self.me}",
                                   json.dumps({"ok": False, "reason": reason}).encode())
      proposal = Decision(False, f"process {self.me}: {reason}")
    key = f"{self._key}/decision"
    if proposal is not None:
      try:
        self._kv.key_value_set_bytes(key, json.dumps(dataclasses.asdict(proposal)).encode(),
                                     allow_overwrite=False)
      except Exception as e:  # noqa: BLE001
        if not _is(e, "ALREADY_EXISTS"):
          raise
    # Whoever wrote first decided; the key exists by now.
    return Decision(**json.loads(self._kv.blocking_key_value_get_bytes(
        key, int(1000 * self.timeout_s))))


def agree(tag: str, processes: Sequence[int], ok: bool, reason: str = "", what: str = "",
          timeout_s: float | None = None) -> Decision:
  """One-step agreement: every process of `processes` gets the same Decision."""
  return Session(tag, processes, what or tag, timeout_s).decide(ok, reason)
