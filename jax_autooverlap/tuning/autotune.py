"""First-call autotuning: time the cost model's best kernel configs and the unfused program.

Opt-in (`OverlapConfig(autotune=True)` or JAX_AUTOOVERLAP_AUTOTUNE=1).  When
the planner meets a shape with no measured verdict on a GPU kind the cost
model covers, it times, on the real devices, the unfused program and the
model's `select.AUTOTUNE_CANDIDATES` fastest configs, and records the fastest
in the user's tuning cache (store.record), so the shape is a measured shape
from then on, in this process and the next ones.

How the timing runs: the planner calls us while JAX traces the user's
program (inside jit).  The timed programs are separate, complete programs
(the canonical op alone in shard_map over the same mesh, on fresh random
inputs), compiled and run in a worker thread: JAX's trace state is
thread-local, so the worker starts from a clean one while the caller's trace
waits.  A fused kernel waits on the other GPUs of its group, so it is only
ever timed as the whole multi-GPU program, every GPU of the group running it.

Agreement: every device must take the same verdict or the programs differ
between GPUs and the kernels wait forever.  In one process that holds by
construction (one decision per trace).  With several processes each one
times the same programs in the same order (all trace the same program), and
rank 0's verdict must win: that needs the rendezvous of the
one-process-per-GPU work, plugged in with `set_rank0_broadcast`.  Until one
is plugged in, multi-process runs do not autotune (the model's choice stands).
"""
from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import sys
import time
from typing import Callable

import numpy as np

from jax_autooverlap.tuning import select, store
from jax_autooverlap.tuning.config import KernelConfig, OverlapConfig

ENV = "JAX_AUTOOVERLAP_AUTOTUNE"
ITERS = 10    # back-to-back calls per batch
BATCHES = 3   # median over batches

# fn(key, payload) -> payload: rank 0's payload, returned in every process.
_rank0_broadcast: Callable[[str, bytes], bytes] | None = None


def set_rank0_broadcast(fn: Callable[[str, bytes], bytes] | None) -> None:
  """Plug in how processes agree (the runtime's rendezvous): fn(key, my_verdict) -> rank 0's."""
  global _rank0_broadcast
  _rank0_broadcast = fn


def enabled(config: OverlapConfig) -> bool:
  return config.autotune or os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _process_count() -> int:
  import jax
  return jax.process_count()


def why_not() -> str | None:
  """Why autotuning cannot run in this process, or None."""
  if _process_count() > 1 and _rank0_broadcast is None:
    return ("several processes and no rendezvous to agree on rank 0's timing: autotuning "
            "skipped, the model's choice stands")
  return None


def time_call(fn, arg_sets, iters: int | None = None, batches: int | None = None) -> float:
  """ms per call of back-to-back calls (what the benchmark and the verdicts measure)."""
  import jax
  iters, batches = iters or ITERS, batches or BATCHES
  for args in arg_sets:  # compile and warm up on every input set
    jax.block_until_ready(fn(*args))
  per_call = []
  for _ in range(batches):
    t0 = time.perf_counter()
    outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(iters)]
    jax.block_until_ready(outs)
    per_call.append((time.perf_counter() - t0) * 1e3 / iters)
    del outs  # free a batch's outputs before the next one
  return float(np.median(per_call))


def in_clean_thread(fn, *args):
  """fn(*args) in a worker thread, whose JAX trace state is clean (not the caller's trace)."""
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ao-autotune") as pool:
    return pool.submit(fn, *args).result()


def _log(msg: str) -> None:
  print(f"[jax_autooverlap autotune] {msg}", file=sys.stderr, flush=True)


def tune(op: str, verdict: select.Verdict,
         time_program: Callable[[KernelConfig | None], float]) -> select.Verdict:
  """Time the unfused program (kernel None) and the candidates; record and return the verdict.

  time_program(kernel) -> ms runs in a clean thread; a candidate that fails is
  reported and skipped (the unfused program must time, or nothing is recorded).
  """
  timed: dict[int, tuple[float, KernelConfig]] = {}
  unfused = in_clean_thread(time_program, None)
  _log(f"{verdict.key}: unfused {unfused:.3f} ms")
  for i, cfg in enumerate(verdict.candidates):
    try:
      ms = in_clean_thread(time_program, cfg)
    except Exception as e:  # noqa: BLE001 - one config failing must not stop the others
      _log(f"{verdict.key}: {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
      continue
    wg = " wg_partitions" if cfg.wg_partitions else ""
    _log(f"{verdict.key}: {cfg.engine}{wg} chunks={cfg.chunks} movers={cfg.num_comm} {ms:.3f} ms")
    timed[i] = (ms, cfg)
  entry = {"date": datetime.date.today().isoformat(), "source": "autotune",
           "unfused_ms": round(unfused, 4)}
  if timed:
    ms, cfg = min(timed.values(), key=lambda t: t[0])
    entry["ours_ms"] = round(ms, 4)
    if ms < unfused:
      entry.update(impl="triton", kernel={f: getattr(cfg, f) for f in cfg.__dataclass_fields__})
  entry.setdefault("impl", "unfused")
  if entry["impl"] == "unfused":
    entry["note"] = "fused kernel not faster" if timed else "kernel failed"
  entry = agree(verdict.key, entry)
  path = store.record(op, verdict.key, entry)
  _log(f"{verdict.key}: {entry['impl']} recorded in {path}")
  return select.measured_verdict(entry, verdict.key)


def agree(key: str, entry: dict) -> dict:
  """The verdict every process takes: this one alone, or rank 0's through the rendezvous."""
  if _process_count() == 1:
    return entry
  payload = _rank0_broadcast(key, json.dumps(entry, sort_keys=True).encode())
  return json.loads(payload.decode())
