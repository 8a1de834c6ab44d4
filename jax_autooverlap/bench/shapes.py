"""The shape list: every projection of a few published LLMs under tensor parallelism, run in
loopback on one GPU in one command.

    python -m jax_autooverlap.bench shapes --loopback [--filter F ...] [--max-shapes N] [--list]
        [--skip-measured JSON ...]   (leave out what earlier runs measured)
        [--bound-unknown-in RUNS ...]   (only the missed entries whose bound those runs do not
                                         tell: "?", e.g. tl ones without the tl kernel alone)
        [--configs-from RUNS ...]   (time again only the configs that ran ours and ours_tl
                                     there, with cuBLAS and the tl kernel alone)
    python -m jax_autooverlap.bench shapes --loopback --table-from JSON ...   (one table of runs)
    python -m jax_autooverlap.bench shapes --loopback --table-from bench/results/shapes-runs.txt
        (the committed table: the runs that list names, in the order they override each other)

The list is package data (data/llm_shapes.json), so an installed benchmark finds it.  Its
`models` are the published dimensions (hidden, intermediate, heads, KV heads, head size; for
Mixtral its experts), its `axes` the group sizes (TP = 2, 4, 8), tokens per step (4k, 8k,
16k) and small M (128 ... 1024: prefill chunks, decode-like steps), and its `entries` the
fused ops, each a global M x K x N over a group of `world` GPUs:
  qkv      ag  M x hidden x (heads + 2 KV heads) * head size   (column parallel)
  o        rs  M x heads * head size x hidden                   (row parallel)
  gate_up  ag  M x hidden x 2 intermediate                      (column parallel)
  down     rs  M x intermediate x hidden                        (row parallel)
where M is the step's tokens, for an expert's MLP (Mixtral) the tokens routed to one expert
on average (tokens x experts per token / experts), or a small M directly.  An op that two
models share (Llama-3-70B's and Qwen2-72B's attention) is one entry, the other model in its
`also`.  One GPU's work is bench/loopback's: ag [M, K] @ [K, N/world], rs [M, K/world] @
[K/world, N].

Each entry runs as bench/loopback's cases do (checked against the unfused result, then timed
interleaved with cuBLAS, the Gluon engine alone, the `tl` engine and its fastest kernel alone,
in a group of one); the table shows per entry ours / cuBLAS, the Gluon engine alone / cuBLAS,
tl / cuBLAS, the tl kernel alone / cuBLAS and the overlap floor on a node /
cuBLAS (max(local GEMM, the bytes from the w - 1 peers at the cost model's copy-engine rate):
where it exceeds the target, the link, not the kernel, is what a node would be bound by) against
the target (issue 27: ours / cuBLAS <= 1.10 where the local GEMM takes >= 20 us, <= 1.25 below)
and, where it is missed, what bounds the entry (bound_by: the link, the engine or the fused
kernel).  Records:
`*-shapes-loopback.json` (bench/records/README.md's loopback fields, plus the entry's
`model`, `projection`, `tokens`, `also`; an entry no kernel can run has impl `unsupported`
and its `reason`), `*-shapes-engine-alone.json`, the table as `.txt`.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import pathlib
import sys
import time

from jax_autooverlap.bench import common
from jax_autooverlap.bench.loopback.cli import variant_name

LIST = pathlib.Path(__file__).parent / "data" / "llm_shapes.json"
# ours / cuBLAS targets: where the local GEMM takes at least TARGET_SPLIT_MS, and below
TARGET_SPLIT_MS = 0.020
TARGETS = (1.10, 1.25)
log = common.logger("shapes")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One fused op of the list: global M x K x N over a group of `world`."""
  model: str
  projection: str  # qkv | o | gate_up | down
  op: str          # ag | rs
  m: int
  k: int
  n: int
  world: int
  tokens: int | None = None  # tokens per step it comes from; None: a small M of the list
  also: tuple[str, ...] = ()  # other models with the same op

  @property
  def fields(self) -> tuple[str, ...]:
    """What --filter matches: models, projection, op, w<world>, m<M>, step or small."""
    return (self.model, *self.also, self.projection, self.op, f"w{self.world}", f"m{self.m}",
            "small" if self.tokens is None else "step")

  @property
  def label(self) -> str:
    return f"{self.model} {self.projection} {self.op} {self.m}x{self.k}x{self.n} w{self.world}"

  def case(self, dtype: str = "bfloat16"):
    from jax_autooverlap.bench.loopback.fixture import Case
    return Case(self.op, self.m, self.k, self.n, dtype=dtype, world=self.world)


def load(path: pathlib.Path = LIST) -> list[Entry]:
  doc = json.loads(pathlib.Path(path).read_text())
  return [Entry(**{**e, "also": tuple(e.get("also", ()))}) for e in doc["entries"]]


def models(path: pathlib.Path = LIST) -> dict:
  return json.loads(pathlib.Path(path).read_text())["models"]


def select(entries: list[Entry], filters=(), max_shapes: int | None = None) -> list[Entry]:
  """The entries matching every filter (each "a|b|...": one of its alternatives equals one of
  the entry's fields), then at most max_shapes of them spread evenly over the list (first and
  last kept), in list order."""
  for f in filters:
    alternatives = set(f.split("|"))
    entries = [e for e in entries if alternatives & set(e.fields)]
  if max_shapes is not None and len(entries) > max_shapes:
    if max_shapes <= 1:
      return entries[:max_shapes]
    step = (len(entries) - 1) / (max_shapes - 1)
    entries = [entries[round(i * step)] for i in range(max_shapes)]
  return entries


def target(gemm_ms: float) -> float:
  """The ours / cuBLAS target at a local GEMM time."""
  return TARGETS[0] if gemm_ms >= TARGET_SPLIT_MS else TARGETS[1]


HEAD = ("model", "proj", "op", "w", "global MxKxN", "local GEMM", "cuBLAS ms", "ours/cuBLAS",
        "ours kernel", "engine/cuBLAS", "tl/cuBLAS", "tl alone/cuBLAS", "floor/cuBLAS", "target",
        "met", "bound by")


def bound_by(ours: float, engine: float, floor: float, goal: float) -> str:
  """What keeps an entry over its target, from its measured ratios to cuBLAS: "link" where the
  overlap floor on a node exceeds it (no kernel gets under it there), "engine" where the
  engine that ran ours, without communication, exceeds it (alone_ratio: tiles, waves, small M,
  for tl also the call's own costs), else "fused" (what the fused kernel adds: waits, pushes,
  the partials' sum); "-" where the target is met, "?" where that engine alone was not
  measured."""
  if math.isnan(ours) or ours <= goal:
    return "-"
  if floor > goal:
    return "link"
  if math.isnan(engine):
    return "?"
  return "engine" if engine > goal else "fused"


def alone_ratio(impls: dict, gemm_ms: float) -> float:
  """The engine of ours alone / cuBLAS: for the Gluon engine its GEMM with its best tiles
  (best_engine), for tl ours_tl's kernel in a group of one (engine_alone_tl); NaN where not
  measured (tl runs before 2026-12-04's sixteenth round: the Gluon engine alone says nothing
  of a tl kernel, which can be the faster)."""
  if impls["ours"].get("engine") == "tl":
    alone = impls.get("engine_alone_tl")
    return alone["median_ms"] / gemm_ms if alone else float("nan")
  return best_engine(impls, gemm_ms)


def best_engine(impls: dict, gemm_ms: float) -> float:
  """The Gluon engine alone / cuBLAS with its best tiles: the fastest of its `tiles_ms` (one
  per tile shape a Gluon variant used), or where a record has none (runs before 2026-12-02's
  fifth round), with the fastest Gluon variant's tiles.  NaN where not measured."""
  alone = impls.get("engine_alone")
  if alone is None:
    return float("nan")
  return min(alone.get("tiles_ms", {}).values(), default=alone["median_ms"]) / gemm_ms


def link_floor_ms(record: dict, gemm_ms: float) -> float:
  """The overlap floor on a node of the entry's group: max(local GEMM, the bytes a GPU receives
  from its w - 1 peers at the link bandwidth of the kind's cost model: the largest copy-engine
  rate measured between two GPUs, which NVSwitch gives to any peer).  Loopback moves those
  bytes through HBM instead, so a loopback ratio below this floor is not reachable on a node.
  NaN where no cost model knows the kind."""
  from jax_autooverlap.bench.loopback.fixture import Case, piece_bytes
  from jax_autooverlap.tuning import model as cost_model
  case = Case(record["op"], record["m"], record["k"], record["n"], dtype=record["dtype"],
              world=record["world_size"])
  # the link is the group's, whatever the operands (only bf16 groups are calibrated)
  model = cost_model.load(record["gpu"].replace("-", " "), case.world, "bfloat16")
  if model is None:
    return float("nan")
  remote_ms = (case.world - 1) * piece_bytes(case) / (model.group.link_gbps * 1e6)
  return max(gemm_ms, remote_ms)


def table_rows(records: list[dict]) -> list[tuple]:
  """One row per entry (records in the order written: an entry's records are adjacent)."""
  by_entry: dict = {}
  for r in records:
    key = (r["model"], r["projection"], r["op"], r["m"], r["k"], r["n"], r["world_size"])
    by_entry.setdefault(key, {})[r["impl"]] = r
  rows = []
  nan = float("nan")
  for (model, proj, op, m, k, n, w), impls in by_entry.items():
    shape = f"{m}x{k}x{n}"
    if "unsupported" in impls:
      rows.append((model, proj, op, w, shape, "-", "-", "-", impls["unsupported"]["reason"], "-",
                   "-", "-", "-", "-", "-", "-"))
      continue
    gemm = impls.get("gemm_alone", {}).get("median_ms", nan)
    ratio = lambda impl: impls[impl]["median_ms"] / gemm if impl in impls else nan
    cell = lambda x, digits=3: "-" if math.isnan(x) else f"{x:.{digits}f}"  # not measured
    ours = ratio("ours")
    goal = target(gemm)
    met = "-" if math.isnan(ours) else ("yes" if ours <= goal else "no")
    local = "x".join(map(str, impls["gemm_alone"]["local_gemm"])) if "gemm_alone" in impls else "-"
    floor = link_floor_ms(impls["gemm_alone"], gemm) / gemm if "gemm_alone" in impls else nan
    rows.append((model, proj, op, w, shape, local, cell(gemm, 4), cell(ours),
                 kernel_name(op, impls["ours"]) if "ours" in impls else "-",
                 cell(ratio("engine_alone")), cell(ratio("ours_tl")),
                 cell(ratio("engine_alone_tl")), cell(floor, 2), f"{goal:.2f}", met,
                 bound_by(ours, alone_ratio(impls, gemm) if "ours" in impls else nan, floor,
                          goal)))
  return rows


def kernel_name(op: str, ours: dict) -> str:
  """The table's name of the fastest variant: its engine and tiles (loopback's variant_name),
  for AG its mover count too."""
  kernel = ours.get("kernel", ours)
  movers = f"-m{kernel['num_comm']}" if op == "ag" and "num_comm" in kernel else ""
  return variant_name(kernel) + movers


def entry_key(r) -> tuple:
  """What identifies an entry of the list in an Entry or a record."""
  if isinstance(r, Entry):
    return (r.model, r.projection, r.op, r.m, r.k, r.n, r.world)
  return (r["model"], r["projection"], r["op"], r["m"], r["k"], r["n"], r["world_size"])


def recorded_configs(records: list[dict]) -> dict[tuple, dict]:
  """{entry_key: {variant name: KernelConfig}} of the configs that ran `ours` and `ours_tl` in
  these records (read_records: each entry's latest run): what --configs-from times again."""
  import dataclasses
  from jax_autooverlap.tuning.config import KernelConfig
  fields = {f.name for f in dataclasses.fields(KernelConfig)}
  out: dict[tuple, dict] = {}
  for r in records:
    if r["impl"] in ("ours", "ours_tl") and "kernel" in r:
      cfg = KernelConfig(**{f: v for f, v in r["kernel"].items() if f in fields})
      out.setdefault(entry_key(r), {})[variant_name(cfg)] = cfg
  return out


def listed_runs(manifest) -> list[pathlib.Path]:
  """The record files a manifest names, one per line relative to its directory, in the order
  they override each other ('#' starts a comment): bench/results/shapes-runs.txt names the
  runs of the committed table."""
  manifest = pathlib.Path(manifest)
  lines = (line.split("#", 1)[0].strip() for line in manifest.read_text().splitlines())
  return [manifest.parent / line for line in lines if line]


def read_records(paths, dtype: str | None = None) -> list[dict]:
  """The records of several runs' JSON files, in list order (entries not in the list last).
  Where two files hold an entry's timed records (or its engine-alone ones), the later file's.
  Only `dtype`'s records where it is given; else the files must hold one operand dtype (an
  entry is the same shape in every dtype: a bf16 and an fp8 run would replace each other's)."""
  latest: dict[tuple, dict[bool, list]] = {}
  files_of: dict[str, dict] = {}
  for path in paths:
    mine: dict[tuple, list] = {}
    for r in json.loads(pathlib.Path(path).read_text()):
      if dtype is not None and r["dtype"] != dtype:
        continue
      files_of.setdefault(r["dtype"], {})[str(path)] = None  # (an ordered set)
      mine.setdefault((entry_key(r), r["impl"] == "engine_alone"), []).append(r)
    for (key, alone), rs in mine.items():
      latest.setdefault(key, {})[alone] = rs
  if len(files_of) > 1:
    raise ValueError("records of several operand dtypes, a table holds one: " + "; ".join(
        f"{d} in {len(files)} file{'s' * (len(files) > 1)} ({next(iter(files))}"
        f"{', ...' * (len(files) > 1)})" for d, files in files_of.items()))
  order = {entry_key(e): i for i, e in enumerate(load())}
  keys = sorted(latest, key=lambda k: order.get(k, len(order)))
  return [r for k in keys for alone in (False, True) for r in latest[k].get(alone, [])]


def format_table(records: list[dict]) -> str:
  rows = [HEAD] + [tuple(map(str, r)) for r in table_rows(records)]
  widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
  dtypes = sorted({r["dtype"] for r in records})
  lines = [f"Shape list in loopback, {' and '.join(dtypes) or 'no'} operands (one GPU as rank 0 "
           "of each group), device time per call; ratios to cuBLAS on the same local GEMM; "
           "floor: the overlap floor on a node, max(local GEMM, bytes from the peers at the "
           "copy-engine rate); -: not measured"]
  lines += ["  ".join(c.rjust(wd) for c, wd in zip(r, widths)) for r in rows]
  done = [r for r in table_rows(records) if r[-2] in ("yes", "no")]
  bounds = collections.Counter(r[-1] for r in done if r[-2] == "no")
  lines.append(f"target met on {sum(r[-2] == 'yes' for r in done)} of {len(done)} measured "
               f"entries" + "".join(f"; bound by {b}: {bounds[b]}"
                                    for b in ("link", "engine", "fused", "?") if bounds[b]))
  return "\n".join(lines)


def first_call_coverage(paths, device_kind: str = "NVIDIA H200", dtype: str = "bfloat16",
                        engines=("tl", "gluon")) -> dict:
  """{op: (entries, geometric mean, count over 1.05, (worst ratio, entry label))}: how close the
  best config a first call times (select.first_call_candidates, no verdict, sm_90) comes to the
  best variant the runs timed, per entry at M <= 1024, from each entry's latest `ours` record
  that timed every variant (not --configs-from).  Configs are matched by engine, tiles,
  split-K and packing (variant_name, less a tail split's tile count and the suffixes of a
  mover sweep and of pipeline depths): the chunks, movers and stages a first call picks are
  not told apart.  How select.SMALL_ORDER was chosen; an entry none of whose candidates was
  timed is left out."""
  import re
  from jax_autooverlap.bench.loopback import cli
  kind = lambda name: re.sub(r"-t\d+", "-t", re.sub(r"(-[ms]\d+)+$", "", name))
  full = {}
  for path in paths:
    for r in json.loads(pathlib.Path(path).read_text()):
      if r["impl"] == "ours" and "configs_from" not in r and r["dtype"] == dtype:
        full[entry_key(r)] = r
  ratios = collections.defaultdict(list)
  for e in load():
    r = full.get(entry_key(e))
    if r is None or e.m > 1024:
      continue
    best = min(r["variants_ms"].values())
    timed = {}
    for name, ms in r["variants_ms"].items():
      timed[kind(name)] = min(timed.get(kind(name), math.inf), ms / best)
    first = {kind(variant_name(c)) for c in
             cli.first_call_variants(e.case(dtype), device_kind, engines).values()}
    got = [timed[name] for name in first if name in timed]
    if got:
      ratios[e.op].append((min(got), e.label))
  return {op: (len(v), math.exp(sum(math.log(x) for x, _ in v) / len(v)),
               sum(x > 1.05 for x, _ in v), max(v)) for op, v in ratios.items()}


def unsupported_reason(entry: Entry, dtype: str) -> str:
  """Why no fused kernel runs this entry (the tuner's reason for its default config)."""
  from jax_autooverlap.bench.loopback.fixture import np_dtype
  from jax_autooverlap.tuning import select
  case = entry.case(dtype)
  dt = np_dtype(dtype)
  return select.unsupported(case.m // case.world, case.local_gemm[1], case.local_gemm[2], dt, dt,
                            select.default_kernel(dt), entry.op) or "no engine runs it"


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(
      prog="python -m jax_autooverlap.bench shapes",
      description="The shape list (projections of Llama-3-8B/70B, Qwen2-72B, Mixtral-8x22B at "
                  "TP = 2, 4, 8; 4k/8k/16k tokens and M = 128..1024) in loopback on one GPU: "
                  "each entry's fused kernel as rank 0 of its group, checked against the "
                  "unfused result, timed against cuBLAS, the Gluon engine alone and the tl "
                  "engine; one table, *-shapes-loopback.json records.")
  ap.add_argument("--loopback", action="store_true", required=True,
                  help="one GPU standing in for each entry's group (the only mode)")
  ap.add_argument("--filter", action="append", default=[],
                  help="keep entries with a field equal to one of a|b|...: a model "
                       "(llama3-8b, llama3-70b, qwen2-72b, mixtral-8x22b), a projection (qkv, o, "
                       "gate_up, down), ag or rs, w2/w4/w8, m<M>, step or small; repeat to "
                       "narrow (all must match)")
  ap.add_argument("--max-shapes", type=int, default=None,
                  help="at most this many entries, spread evenly over the filtered list")
  ap.add_argument("--list", action="store_true",
                  help="print the selected entries and their per-rank GEMMs, run nothing")
  ap.add_argument("--shapes-file", default=str(LIST),
                  help="the list (default: the package's %(default)s)")
  ap.add_argument("--dtype", default="bfloat16", help="operand dtype (default: %(default)s)")
  ap.add_argument("--engines", default="tl,gluon",
                  help="fused-kernel engines, comma-separated (default: %(default)s)")
  ap.add_argument("--rounds", type=int, default=5,
                  help="interleaved rounds per entry (default: %(default)s)")
  ap.add_argument("--calls", type=int, default=20,
                  help="back-to-back calls per round (default: %(default)s)")
  ap.add_argument("--time-budget", type=float, default=None,
                  help="seconds: start no entry after this long (the table of what ran is "
                       "still printed)")
  ap.add_argument("--skip-measured", nargs="+", default=[], metavar="JSON",
                  help="skip the entries these *-shapes-loopback.json files already hold in "
                       "--dtype (a list measured over several runs)")
  ap.add_argument("--bound-unknown-in", nargs="+", default=[], metavar="JSON",
                  help="run only the entries whose row in the table of these record files (or "
                       ".txt lists of them, as --table-from) misses its target with bound '?' "
                       "(what keeps it over was not measured)")
  ap.add_argument("--table-from", nargs="+", default=[], metavar="JSON",
                  help="run nothing: print the table of these record files "
                       "(*-shapes-loopback.json and *-shapes-engine-alone.json of several runs, "
                       "all of one dtype; one row per entry, in list order, the latest run's "
                       "where two hold it); a .txt names such files (listed_runs)")
  ap.add_argument("--first-call-coverage", nargs="+", default=[], metavar="JSON",
                  help="run nothing: per op, how close the best config a first call times "
                       "comes to the best variant these runs (or .txt lists of them) timed, "
                       "over the entries at M <= 1024 (first_call_coverage)")
  ap.add_argument("--configs-from", nargs="+", default=[], metavar="JSON",
                  help="time again only the configs that ran ours and ours_tl in these record "
                       "files (or .txt lists of them) for each entry, with cuBLAS and the tl "
                       "kernel alone (what a missing engine_alone_tl needs, at a fraction of a "
                       "full run's compiles); entries they do not hold are skipped")
  from jax_autooverlap.bench.loopback.cli import add_variant_arguments
  add_variant_arguments(ap)
  ap.add_argument("--tag", default="", help="suffix of the output file names")
  ap.add_argument("--out", default="bench/results",
                  help="directory of the JSON and table (default: %(default)s)")
  return ap


def write_records(stem: pathlib.Path, tag: str, records: list[dict]) -> pathlib.Path:
  """Write the run's records so far: the fused kernels' and cuBLAS's to
  <stem>-loopback<tag>.json (returned), the engine alone's to <stem>-engine-alone<tag>.json
  (where there are any), both read back by --table-from."""
  path = stem.with_name(stem.name + f"-loopback{tag}.json")
  path.write_text(json.dumps([r for r in records if r["impl"] != "engine_alone"], indent=1))
  engine = [{**r, "mode": "engine"} for r in records if r["impl"] == "engine_alone"]
  if engine:
    stem.with_name(stem.name + f"-engine-alone{tag}.json").write_text(
        json.dumps(engine, indent=1))
  return path


def main(argv=None) -> int:
  args = parser().parse_args(sys.argv[1:] if argv is None else argv)
  from jax_autooverlap.bench.loopback.cli import parse_movers, parse_variants
  movers, extra = parse_movers(args.movers), parse_variants(args.variant)
  paths = lambda values: [q for p in values
                          for q in (listed_runs(p) if p.endswith(".txt") else [pathlib.Path(p)])]
  if args.table_from:
    try:
      records = read_records(paths(args.table_from))
    except ValueError as e:
      print(f"bench shapes --table-from: {e}", file=sys.stderr)
      return 2
    print(format_table(records))
    return 0
  if args.first_call_coverage:
    for op, (n, mean, over, (worst, label)) in sorted(
        first_call_coverage(paths(args.first_call_coverage), dtype=args.dtype).items()):
      print(f"{op}: {n} entries at M <= 1024: the first call's best / the best timed: geometric "
            f"mean {mean:.4f}, {over} over 1.05, worst {worst:.3f} ({label})")
    return 0
  entries = select(load(pathlib.Path(args.shapes_file)), args.filter, args.max_shapes)
  if args.bound_unknown_in:
    unknown = {row[:5] for row in table_rows(read_records(paths(args.bound_unknown_in),
                                                          args.dtype)) if row[-1] == "?"}
    left = [e for e in entries
            if (e.model, e.projection, e.op, e.world, f"{e.m}x{e.k}x{e.n}") in unknown]
    log(f"{len(left)} of {len(entries)} selected entries miss their target with an unknown "
        f"bound in {', '.join(args.bound_unknown_in)}")
    entries = left
  if args.skip_measured:
    done = {entry_key(r) for r in read_records(args.skip_measured, args.dtype)
            if r["impl"] != "engine_alone"}
    left = [e for e in entries if entry_key(e) not in done]
    log(f"{len(entries) - len(left)} of {len(entries)} selected entries already measured "
        f"({', '.join(args.skip_measured)}): skipped")
    entries = left
  recorded = {}
  if args.configs_from:
    recorded = recorded_configs(read_records(paths(args.configs_from), args.dtype))
    left = [e for e in entries if entry_key(e) in recorded]
    log(f"{len(entries) - len(left)} of {len(entries)} selected entries have no recorded "
        f"config in {', '.join(args.configs_from)}: skipped")
    entries = left
  if args.list:
    for e in entries:
      print(f"{e.label}  local {'x'.join(map(str, e.case(args.dtype).local_gemm))}"
            + (f"  ({e.tokens} tokens)" if e.tokens else "")
            + (f"  also {','.join(e.also)}" if e.also else ""))
    print(f"{len(entries)} entries")
    return 0
  import numpy as np
  from jax_autooverlap.bench.loopback import cli
  gpus, engines = cli.gpus_and_engines(args.engines, "bench shapes --loopback")
  if not gpus:
    return 2
  gpu, versions = common.gpu_name(gpus[0]), common.versions()
  date = datetime.date.today().isoformat()
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = out_dir / f"{gpu}-x1-{date}-shapes"
  records = []
  start = time.monotonic()
  for i, e in enumerate(entries, 1):
    if args.time_budget is not None and time.monotonic() - start > args.time_budget:
      log(f"time budget of {args.time_budget:.0f} s spent: entries {i}..{len(entries)} not run")
      break
    case = e.case(args.dtype)
    log(f"[{i}/{len(entries)}] {e.label} (local GEMM {'x'.join(map(str, case.local_gemm))})")
    base = {"model": e.model, "projection": e.projection, "tokens": e.tokens,
            "also": list(e.also), "op": e.op, "m": e.m, "k": e.k, "n": e.n,
            "dtype": args.dtype, "world_size": e.world, "mode": "loopback",
            "local_gemm": list(case.local_gemm), "gpu": gpu, "versions": versions, "date": date}
    variants = recorded.get(entry_key(e))
    if variants is not None:
      variants = {name: cfg for name, cfg in variants.items() if cfg.engine in engines}
      if not variants:
        log(f"[{i}/{len(entries)}] {e.label}: skipped: its recorded configs "
            f"({', '.join(recorded[entry_key(e)])}) are not on {', '.join(engines)}")
        continue
      base["configs_from"] = list(args.configs_from)
    if variants is None and not cli.kernel_configs(case, gpus[0].device_kind, engines):
      reason = unsupported_reason(e, args.dtype)
      log(f"[{i}/{len(entries)}] {e.label}: unsupported: {reason}")
      records.append({**base, "impl": "unsupported", "reason": reason})
      continue
    try:
      measured = cli.bench_case(case, gpus[0], engines, args.rounds, args.calls, movers,
                                args.first_call_candidates, extra, variants, args.stages)
    except Exception as ex:  # noqa: BLE001 - report, go on with the list
      log(f"[{i}/{len(entries)}] {e.label} failed: {type(ex).__name__}: {str(ex)[:400]}")
      records.append({**base, "impl": "unsupported", "reason": f"failed: {type(ex).__name__}"})
      continue
    records += [{**base, **r} for r in measured]
    write_records(stem, args.tag, records)  # after every entry: a run cut short keeps them
    gemm = next((r["median_ms"] for r in measured if r["impl"] == "gemm_alone"), np.nan)
    summary = ", ".join(f"{r['impl']} {r['median_ms'] / gemm:.3f}" for r in measured
                        if r["impl"] != "gemm_alone")
    log(f"[{i}/{len(entries)}] {e.label}: cuBLAS {gemm:.4f} ms; {summary}")
  path = write_records(stem, args.tag, records)
  table = format_table(records)
  path.with_suffix(".txt").write_text(table + "\n")
  print(f"wrote {path}")
  print(table)
  return 0
