"""The tuning cache on disk: measured verdicts and calibrated cost-model parameters.

Two places hold them: the JSON shipped in tuning/data/ and the user's cache
directory (`user_cache_dir()`), where first-call measurement,
`python -m jax_autooverlap.bench ...` and calibration write.  User entries
win.  Files are replaced atomically under a lock, so another process reads
the old file or the new one and concurrent writers lose no entry.

A verdict holds for the kernels it was measured with: every entry carries
`kernel_hash`, the hash of the sources that define what the fused kernels
compile to (`kernel_hash()`), and an entry with another hash (or none: the
verdicts shipped before hashes were recorded) is stale: `verdicts()` leaves it
out and `stale()` says why, so the shape is measured again.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import re
import tempfile

DATA = pathlib.Path(__file__).parent / "data"
PACKAGE = pathlib.Path(__file__).parents[1]
# What a fused kernel compiles to: the kernels, their launchers, the compile pipeline shims.
KERNEL_SOURCES = ("kernels/*.py", "backends/*.py", "_compat.py")


def user_cache_dir() -> pathlib.Path:
  """Where measured verdicts and calibrations go ($JAX_AUTOOVERLAP_CACHE_DIR or ~/.cache)."""
  env = os.environ.get("JAX_AUTOOVERLAP_CACHE_DIR")
  return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "jax_autooverlap"


@functools.cache
def kernel_hash() -> str:
  """sha256 (16 hex digits) of the kernel sources: their paths and bytes, in path order."""
  h = hashlib.sha256()
  for path in sorted(p for pattern in KERNEL_SOURCES for p in PACKAGE.glob(pattern)):
    h.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
  return h.hexdigest()[:16]


def write_json_atomic(path: pathlib.Path, data) -> None:
  """Readers (other processes too) see the old file or the new one, never a partial one.

  Lists of numbers are written on one line (the model's measured points).
  """
  text = json.dumps(data, indent=1, sort_keys=True)
  text = re.sub(r"\[\s+([-0-9.e,\s]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]",
                text)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    f.write(text + "\n")
  os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: pathlib.Path):
  """An exclusive lock on `path`'s lock file: one read-modify-write at a time, across processes."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path.with_name(path.name + ".lock"), "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def shipped_entries() -> dict:
  """The verdicts shipped in tuning/data/, stale or not, by cache key."""
  entries = {}
  for path in sorted(DATA.glob("ag_*.json")) + sorted(DATA.glob("rs_*.json")):
    entries.update(json.loads(path.read_text()))
  return entries


@functools.cache
def _all_entries() -> dict:
  """Every verdict: shipped, then the user's (read once per process; `record` adds to it)."""
  entries = shipped_entries()
  for path in sorted(user_cache_dir().glob("tuning-*.json")):
    entries.update(json.loads(path.read_text()))
  return entries


def staleness(entry: dict) -> str | None:
  """Why a verdict no longer holds for these kernels, or None."""
  measured = entry.get("kernel_hash")
  if measured == kernel_hash():
    return None
  if measured is None:
    return "measured with an earlier kernel source (before kernel hashes were recorded)"
  return f"measured with other kernel sources (hash {measured}, these are {kernel_hash()})"


@functools.cache
def verdicts() -> dict:
  """Measured verdicts by cache key that hold for these kernels (user entries win)."""
  return {key: e for key, e in _all_entries().items() if staleness(e) is None}


def stale() -> dict:
  """key -> why, for the verdicts left out of `verdicts()`."""
  return {key: why for key, e in _all_entries().items() if (why := staleness(e)) is not None}


def clear_cache() -> None:
  """Forget what this process read (the next lookup reads the files again)."""
  _all_entries.cache_clear()
  verdicts.cache_clear()


def stamped(entry: dict) -> dict:
  """`entry` with the hash of these kernels (what it was measured with)."""
  return {**entry, "kernel_hash": kernel_hash()}


def record(op: str, key: str, entry: dict, persist: bool = True) -> pathlib.Path | None:
  """Add a verdict measured with these kernels to this process's view and, if `persist`, to the
  user's cache (returns the file)."""
  entry = stamped(entry)
  verdicts()[key] = entry
  if not persist:
    return None
  path = user_cache_dir() / f"tuning-{op}.json"
  merge(path, {key: entry})
  return path


def merge(path: pathlib.Path, entries: dict) -> None:
  """Add `entries` to the JSON file of verdicts at `path` (newest win), under its lock."""
  with _locked(path):
    cache = json.loads(path.read_text()) if path.exists() else {}
    cache.update(entries)
    write_json_atomic(path, cache)


def model_param_files() -> list[pathlib.Path]:
  """Cost-model parameter files: shipped, then the user's calibrations (later ones win)."""
  return sorted(DATA.glob("model_*.json")) + sorted(user_cache_dir().glob("model_*.json"))
