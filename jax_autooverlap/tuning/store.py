"""The tuning cache on disk: measured verdicts and calibrated cost-model parameters.

Two places hold them: the JSON shipped in tuning/data/ and the user's cache
directory (`user_cache_dir()`), where `python -m jax_autooverlap.bench ...`,
calibration and first-call autotuning write.  User entries win.  Files are
replaced atomically, so another process reads the old file or the new one.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import tempfile

DATA = pathlib.Path(__file__).parent / "data"


def user_cache_dir() -> pathlib.Path:
  """Where measured verdicts and calibrations go ($JAX_AUTOOVERLAP_CACHE_DIR or ~/.cache)."""
  env = os.environ.get("JAX_AUTOOVERLAP_CACHE_DIR")
  return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "jax_autooverlap"


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


@functools.cache
def verdicts() -> dict:
  """Measured verdicts by cache key: shipped, then the user's (read once per process;
  `record` adds to it)."""
  entries = {}
  shipped = sorted(DATA.glob("ag_*.json")) + sorted(DATA.glob("rs_*.json"))
  for path in shipped + sorted(user_cache_dir().glob("tuning-*.json")):
    entries.update(json.loads(path.read_text()))
  return entries


def record(op: str, key: str, entry: dict) -> pathlib.Path:
  """Add a measured verdict to the user's cache (file and this process's view of it)."""
  path = user_cache_dir() / f"tuning-{op}.json"
  cache = json.loads(path.read_text()) if path.exists() else {}
  cache[key] = entry
  write_json_atomic(path, cache)
  verdicts()[key] = entry
  return path


def model_param_files() -> list[pathlib.Path]:
  """Cost-model parameter files: shipped, then the user's calibrations (later ones win)."""
  return sorted(DATA.glob("model_*.json")) + sorted(user_cache_dir().glob("model_*.json"))
