"""The parts of a traced program that ao.jit rewrote, and what their rewrite reported.

Every program an `ao.jit` function contributes (its primal program, and under
differentiation its forward and backward programs) runs as a named jit call
whose name (`ao_jit__<function>__<pass>__<n>`) keys the rewrite's report
here.  The name stays in every jaxpr that holds the call, also in traces JAX
caches, so `ao.explain` can find each region of any program and say what was
fused there, and what runs outside every region.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import threading

from jax_autooverlap.rewrite.match import Report

KINDS = ("primal", "fwd", "bwd")
_NAME = re.compile(r"^ao_jit__(\w*?)__(primal|fwd|bwd)__(\d+)$")


@dataclasses.dataclass(frozen=True)
class Region:
  function: str  # the ao.jit function's name
  kind: str      # "primal" (not differentiated) | "fwd" | "bwd" (its programs under autodiff)
  report: Report


_counter = itertools.count()
_lock = threading.Lock()
_REGIONS: dict[str, Region] = {}


def new_name(function: str, kind: str) -> str:
  """A fresh region name for one rewrite of `function`'s `kind` program."""
  assert kind in KINDS, kind
  with _lock:
    n = next(_counter)
  return f"ao_jit__{re.sub(r'[^0-9A-Za-z_]', '_', function)}__{kind}__{n}"


def record(name: str, function: str, report: Report) -> None:
  kind = _NAME.match(name).group(2)
  with _lock:
    _REGIONS[name] = Region(function, kind, report)


def of_eqn(eqn) -> Region | None:
  """The region a jit equation is (None: not an ao.jit region, or one this process did not
  rewrite)."""
  if eqn.primitive.name not in ("pjit", "jit"):
    return None
  name = str(eqn.params.get("name", ""))
  return _REGIONS.get(name) if _NAME.match(name) else None
