"""First-call measurement: time the kernel candidates against the unfused program and decide,
every process of the mesh taking the same decision.

Where no measured verdict exists for a shape (tuning/select.py returns a
"first_call" verdict with its candidates), the op's first trace times, on the
call's own GPUs, the unfused program and each candidate, and records the
verdict in the user's cache (tuning/store.py): from then on it is a measured
shape, in this process and the next ones.  ops/measure.py builds the programs
(the op alone in shard_map over the call's mesh, on fresh random inputs,
checked against a reference) and the agreement (runtime/rendezvous.py); this
module holds the protocol and the decision, which see them through two small
interfaces (`Program`, `Agreement`) so that tests can inject timings.

Protocol (`measure`): the same steps in every process of the mesh, in the same
order (they trace the same program, so they reach the op together), each step
ending with an exchange of what every process saw:
  1. compile every program (several at once: compile_all); keep those that compiled
     everywhere;
  2. run each once per input set and check its result; keep those that ran and
     passed everywhere; calls per round from the slowest process's time per
     call, so that every process makes the same calls (a fused kernel waits
     for its peers' calls);
  3. `ROUNDS` interleaved rounds (the program order rotated each round), each
     program `iters` back-to-back calls per round; exchange the rounds.
A program's time in a round is the max over processes: a collective is as slow
as its slowest member, and every process then holds the same table, from which
`decide` takes the same verdict everywhere (rank 0's verdict would serve too,
but would ignore a GPU that runs slower than rank 0's).  Then every process
votes (`Agreement.conclude`): if any failed or timed out, all keep the unfused
program with the same reason, and record nothing.

The decision (`decide`): per round, each candidate's time over the unfused
program's in the same round (interleaving puts both under the same clocks and
power state, which moved 5-8 % round to round on H200 under its power cap);
the candidate with the lowest median ratio wins, and runs only if that median
is below 1 - margin, margin = max(MIN_MARGIN, Z x standard error of the median
ratio) (docs/NOTES.md says why).  A candidate that fails (compile error, run
error such as a bounded wait that expired, a result off the reference) is
dropped.  Where the unfused program fails (several processes sharing one GPU:
NCCL refuses them) the fastest candidate that passed runs.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import math
import os
import sys
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from jax_autooverlap.tuning import select, store
from jax_autooverlap.tuning.config import KernelConfig

ITERS = 10    # time_call: back-to-back calls per batch
BATCHES = 3   # time_call: median over batches
ROUNDS = 7    # interleaved rounds of the first-call measurement
ROUND_MS = 20.0  # calls per round: about this long for each program
MAX_ITERS = 100
COMPILE_THREADS = 8  # programs compiled at once (compile_all)
Z = 2.0  # standard errors a candidate's median ratio must clear
MIN_MARGIN = 0.01
UNFUSED = "unfused"


class Program(Protocol):
  """One timed program: the unfused program or a kernel candidate."""
  label: str

  def compile(self) -> None: ...
  def check(self) -> None: ...           # run once per input set, raise if a result is off
  def time(self, iters: int) -> float: ...  # ms per call of `iters` back-to-back calls


class Agreement(Protocol):
  """How the processes of the mesh agree (in one process: trivially)."""
  first: bool  # this process writes the progress lines

  def exchange(self, step: str, payload) -> dict: ...   # every process's payload, by process
  def conclude(self, ok: bool, reason: str) -> tuple[bool, str]: ...  # the same in every process


def time_call(fn, arg_sets, iters: int | None = None, batches: int | None = None) -> float:
  """ms per call of back-to-back calls (what the benchmarks measure)."""
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


def log(msg: str) -> None:
  """A progress line on stderr (the lowest process of the mesh writes them)."""
  print(f"[jax_autooverlap] {msg}", file=sys.stderr, flush=True)


def _error(e: BaseException) -> str:
  return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _agree_on(step: str, programs: Sequence[Program], failed: dict, new: dict,
              agreement: Agreement, extra: dict | None = None) -> dict:
  """Exchange this step's new failures here (`new`, label -> error) and `extra` per program;
  add every process's to `failed` (the lowest failing process's error, the same string in
  every process); return every process's payload."""
  mine = {p.label: {"error": new.get(p.label), **(extra or {}).get(p.label, {})}
          for p in programs}
  seen = agreement.exchange(step, mine)
  for p in programs:
    errors = [(proc, seen[proc][p.label]["error"]) for proc in sorted(seen)
              if seen[proc][p.label]["error"] is not None]
    if errors and p.label not in failed:
      proc, error = errors[0]
      failed[p.label] = error if len(seen) == 1 else f"process {proc}: {error}"
  return seen


def compile_all(programs: Sequence[Program]) -> dict[str, str]:
  """Compile every program, up to COMPILE_THREADS at once; label -> error of those that failed.
  Lowering a fused kernel's program compiles the kernel with Triton, which runs outside the GIL
  for much of its time (four tl configs: 4.7 s one after the other, 2.9 s in four threads on
  two cores), and XLA's compile releases it too.  The programs of one shape share one
  workspace size, so their lowerings take the workspace registry's lock without growing it
  (runtime/workspace.py); each thread starts with a clean JAX trace state."""
  def one(p):
    try:
      p.compile()
    except Exception as e:  # noqa: BLE001 - a candidate failing is a verdict, not an error
      return f"compile: {_error(e)}"
    return None
  errors = in_threads(one, programs)
  return {p.label: e for p, e in zip(programs, errors) if e is not None}


def in_threads(fn, items, limit: int = COMPILE_THREADS) -> list:
  """[fn(item) for item in items], up to `limit` (and the CPU count) at once, each in a thread
  with a clean JAX trace state."""
  items = list(items)
  workers = max(1, min(limit, len(items), os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ao-compile") as pool:
    return list(pool.map(fn, items))


def measure(programs: Sequence[Program], agreement: Agreement, rounds: int = ROUNDS) -> dict:
  """label -> per-round ms (max over processes), or the error that dropped the program."""
  failed: dict[str, str] = {}
  new = compile_all(programs)
  _agree_on("compiled", programs, failed, new, agreement)
  new, first = {}, {}
  for p in programs:
    if p.label in failed:
      continue
    try:
      p.check()
      first[p.label] = {"ms": p.time(1)}
    except Exception as e:  # noqa: BLE001
      new[p.label] = _error(e)
  seen = _agree_on("checked", programs, failed, new, agreement, first)
  live = [p for p in programs if p.label not in failed]
  iters = {p.label: min(MAX_ITERS, max(1, math.ceil(ROUND_MS / max(
      max(s[p.label]["ms"] for s in seen.values()), 1e-3)))) for p in live}
  times: dict[str, list[float]] = {p.label: [] for p in live}
  new = {}
  for r in range(rounds):
    shift = r % max(1, len(live))
    for p in live[shift:] + live[:shift]:  # each program leads one round in turn
      if p.label in new:
        continue
      try:
        times[p.label].append(p.time(iters[p.label]))
      except Exception as e:  # noqa: BLE001
        new[p.label] = _error(e)
  seen = _agree_on("timed", programs, failed, new, agreement,
                   {p.label: {"rounds": times.get(p.label)} for p in programs})
  return {p.label: failed[p.label] if p.label in failed else
          [max(s[p.label]["rounds"][r] for s in seen.values()) for r in range(rounds)]
          for p in programs}


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What the measurement decided."""
  choice: int | None         # the candidate that runs, None: the unfused program
  note: str                  # why, in words
  ours_ms: float | None      # median ms of the chosen (else the fastest) candidate
  unfused_ms: float | None   # median ms of the unfused program (None: it failed)
  margin: float | None       # the margin the fastest candidate had to clear
  failed: dict               # label -> error of each program dropped
  persist: bool = True       # a verdict worth keeping (something ran)


def margin_of(ratios: Sequence[float]) -> float:
  """The margin a candidate with these per-round ratios (candidate / unfused) must clear:
  Z standard errors of their median (1.2533 sigma / sqrt(n), sigma from the median absolute
  deviation, robust to an odd round), never below MIN_MARGIN."""
  q = np.asarray(ratios, np.float64)
  sigma = 1.4826 * float(np.median(np.abs(q - np.median(q))))
  return max(MIN_MARGIN, Z * 1.2533 * sigma / math.sqrt(len(q)))


def decide(unfused, candidates: Sequence) -> Outcome:
  """The verdict from the agreed table: `unfused` and each of `candidates` either per-round ms
  (the same rounds, interleaved) or the error that dropped it (module docstring)."""
  failed = {UNFUSED: unfused} if isinstance(unfused, str) else {}
  failed.update({str(i): c for i, c in enumerate(candidates) if isinstance(c, str)})
  live = [i for i, c in enumerate(candidates) if not isinstance(c, str)]
  median = lambda xs: float(np.median(xs))
  if not live:
    what = "every kernel candidate failed" if candidates else "no kernel candidate"
    first = next((failed[str(i)] for i in range(len(candidates))), "")
    return Outcome(None, what + (f" ({first})" if first else ""), None,
                   None if isinstance(unfused, str) else median(unfused), None, failed,
                   persist=not isinstance(unfused, str))
  if isinstance(unfused, str):  # no reference time: the fastest candidate that passed its checks
    best = min(live, key=lambda i: (median(candidates[i]), i))
    return Outcome(best, f"the unfused program failed here ({unfused}); fastest kernel config",
                   median(candidates[best]), None, None, failed)
  ratios = {i: [c / u for c, u in zip(candidates[i], unfused)] for i in live}
  best = min(live, key=lambda i: (median(ratios[i]), i))
  ratio, margin = median(ratios[best]), margin_of(ratios[best])
  ours, base = median(candidates[best]), median(unfused)
  gain = 1 - ratio
  if gain > margin:
    return Outcome(best, f"fused kernel {100 * gain:.1f} % faster (margin {100 * margin:.1f} %)",
                   ours, base, margin, failed)
  how = (f"{100 * gain:.1f} % faster, within the margin {100 * margin:.1f} %" if gain > 0
         else f"{100 * -gain:.1f} % slower")
  return Outcome(None, f"fused kernel {how}", ours, base, margin, failed)


def _config(cfg: KernelConfig) -> str:
  """A candidate as the progress lines and a verdict's failures name it: engine, chunks and
  movers, then what differs from the default tiles (small-shape candidates share the rest)."""
  wg = " wg_partitions" if cfg.wg_partitions else ""
  tiles = "" if (cfg.block_m, cfg.block_n) == (128, 256) else f" tiles={cfg.block_m}x{cfg.block_n}"
  split = (f" split_k={cfg.split_k}" if cfg.split_k > 1 else "") + \
      (f" split_tail={cfg.split_tail}" if cfg.split_tail else "")
  packed = " packed" if cfg.pack_shards else ""
  return f"{cfg.engine}{wg} chunks={cfg.chunks} movers={cfg.num_comm}{tiles}{split}{packed}"


def entry_of(outcome: Outcome, candidates: Sequence[KernelConfig], date: str, processes: int,
             rounds: int) -> dict:
  """The cache entry of an outcome (built from agreed data only: identical in every process)."""
  entry = {"source": "first_call", "date": date, "note": outcome.note, "rounds": rounds,
           "processes": processes, "candidates": len(candidates),
           "unfused_ms": None if outcome.unfused_ms is None else round(outcome.unfused_ms, 4),
           "ours_ms": None if outcome.ours_ms is None else round(outcome.ours_ms, 4)}
  if outcome.margin is not None:
    entry["margin"] = round(outcome.margin, 4)
  if outcome.failed:
    entry["failed"] = {(UNFUSED if k == UNFUSED else _config(candidates[int(k)])): v
                       for k, v in sorted(outcome.failed.items())}
  if outcome.choice is None:
    entry["impl"] = "unfused"
  else:
    cfg = candidates[outcome.choice]
    entry.update(impl="triton", kernel=dataclasses.asdict(cfg))
  return entry


def tune(op: str, verdict: select.Verdict, programs: Callable[[], list], agreement: Agreement,
         what: str, processes: int = 1) -> select.Verdict:
  """Measure `verdict.candidates` (programs(): [unfused, candidate 0, ...]), agree, record and
  return the verdict every process takes; `what` names the call in the progress lines."""
  candidates = tuple(verdict.candidates)
  if agreement.first:
    log(f"timing {what}: unfused + {len(candidates)} candidates ...")
  t0 = time.perf_counter()
  try:
    table = in_clean_thread(lambda: measure(programs(), agreement))
    outcome = decide(table[UNFUSED], [table[str(i)] for i in range(len(candidates))])
    date = agreement.exchange("date", datetime.date.today().isoformat())
    ok, why = True, ""
  except Exception as e:  # noqa: BLE001 - a process failing must not leave the others waiting
    ok, why = False, _error(e)
  ok, why = agreement.conclude(ok, why)
  if not ok:  # kept in this process only: the next process measures again
    entry = {"impl": "unfused", "source": "first_call", "measure_failed": True,
             "note": f"the first-call measurement failed ({why})"}
    store.record(op, verdict.key, entry, persist=False)
    if agreement.first:
      log(f"{what}: unfused program: {entry['note']}")
    return select.measured_verdict(store.stamped(entry), verdict.key)
  entry = entry_of(outcome, candidates, date[min(date)], processes, ROUNDS)
  path = store.record(op, verdict.key, entry, persist=outcome.persist)
  if agreement.first:
    chosen = "unfused program" if outcome.choice is None else \
        f"kernel {_config(candidates[outcome.choice])}"
    log(f"{what}: {chosen}: {outcome.note} [{time.perf_counter() - t0:.1f} s]"
        + (f", recorded in {path}" if path else ", not recorded"))
  return select.measured_verdict(store.stamped(entry), verdict.key)
