"""Fit the cost model (tuning/model.py) on benchmark records, and check it leave-one-shape-out.

    python -m jax_autooverlap.tuning.fit [--records bench/records] [--gemm CALIBRATION.json]
        [--out jax_autooverlap/tuning/data/model_NVIDIA-H200.json] [--check]

Records are what `python -m jax_autooverlap.bench ag|rs` (and the multi-GPU
part of `calibrate`) write: per shape the unfused program, ours (one record
per kernel config timed), the local GEMM alone and the remote bytes moved
alone (fields: bench/records/README.md, where the shipped model's records are).
From them:
  - cuBLAS GEMM rates: the `gemm_alone` records (unless single-GPU calibration
    points are given), leaving out calls too short to be timed from the host;
  - collective curves: unfused - the GEMM model at the same shape, per byte count;
  - link bandwidth: the fastest `transfer_alone` record;
  - the host floor of a plain multi-GPU program: the GEMM-alone calls that were
    too short (they measured dispatch, not the GEMM);
  - the fused kernels' parameters (tile kappa and fixed cost unless calibrated
    on one GPU, mover bandwidth, RS exchange cost, per-call cost, host floor of
    a fused program): least squares on log(predicted / measured) of every
    `ours` record, robust (soft-L1 beyond 10 %) so that one odd shape does not pull them.
The flag round-trip latency is not identifiable from these records; it is an
input (measured on 2xH200: a cross-GPU flag exchange incl. round trip 5-8 us,
see the design notes).  Nor is the push bandwidth of one mover CTA where the
records hold only the fastest config of each shape (the benchmark's): a weak
prior keeps it where 12 movers fill the link, so that the data move it only
where they tell (calibrate's records, one per config, do).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import sys

import numpy as np

from jax_autooverlap.tuning import model as cost_model
from jax_autooverlap.tuning.config import KernelConfig

# Below this a back-to-back call of a 2-GPU program measures host dispatch
# (85-110 us per call, measured on 2xH200), not the GPU work.
MIN_DEVICE_MS = 0.15
FLAG_LATENCY_US = 5.0
DEFAULT_TILE = "128x256x64"
# Fitted parameters: (name, initial value, lower bound, upper bound).
_FUSED = (("kappa", 1.05, 0.7, 1.6), ("fixed_us", 2.0, 0.0, 30.0),
          ("mover_gbps_per_cta", 30.0, 1.0, 500.0), ("rs_exchange_us_per_kib", 0.3, 0.0, 5.0),
          ("call_us", 10.0, 0.0, 200.0), ("fused_floor_ms", 0.1, 0.0, 10.0))
_TILE_PARAMS = ("kappa", "fixed_us")
MOVERS_FILLING_LINK = 12   # the prior of mover_gbps_per_cta: link_gbps / 12
PRIOR_WEIGHT = 0.05        # its residual per e-fold away from the prior


@dataclasses.dataclass(frozen=True)
class Shape:
  op: str
  m: int  # global M x K x N, as the benchmark names shapes
  k: int
  n: int
  world: int
  dtype: str
  gpu: str

  @property
  def per_device(self) -> tuple[int, int, int]:
    """(rows, k, cols) per device as the tuner and the model see them."""
    if self.op == "ag":
      return self.m // self.world, self.k, self.n // self.world
    return self.m, self.k // self.world, self.n

  @property
  def local_gemm(self) -> tuple[int, int, int]:
    """(M, N, K) of the GEMM each device runs."""
    rows, k, cols = self.per_device
    return ((self.world * rows, cols, k) if self.op == "ag" else (rows, cols, k))

  @property
  def collective_bytes(self) -> int:
    itemsize = np.dtype(self.dtype).itemsize
    if self.op == "ag":
      return (self.world - 1) * (self.m // self.world) * self.k * itemsize
    return (self.world - 1) * (self.m // self.world) * self.n * itemsize

  @property
  def name(self) -> str:
    return f"{self.op} {self.m}x{self.k}x{self.n}"


def record_files(paths) -> list[pathlib.Path]:
  """The JSON files of `paths`: files as given, directories by their *.json (not recursive)."""
  return [f for p in map(pathlib.Path, paths)
          for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]


def load_records(paths) -> list[dict]:
  """Benchmark records from JSON files or directories of them: the benchmark's record lists
  and the records inside calibration files (other JSON is skipped, and so are loopback
  records: one GPU standing in for a group, not a group's timing; and fused-kernel records of
  an engine other than `tl`: the model's tile costs and movers describe the tl kernels)."""
  out = []
  for f in record_files(paths):
    data = json.loads(f.read_text())
    if isinstance(data, dict):
      data = data.get("measurements", {}).get("records", [])
    if isinstance(data, list):
      out += [r for r in data if isinstance(r, dict) and {"op", "impl", "median_ms"} <= set(r)
              and r.get("mode") != "loopback"
              and (r.get("kernel") or {}).get("engine", "tl") == "tl"]
  return out


def by_shape(records) -> dict[Shape, dict[str, list[dict]]]:
  shapes: dict[Shape, dict[str, list[dict]]] = {}
  for r in records:
    s = Shape(r["op"], r["m"], r["k"], r["n"], r["world_size"], r["dtype"], r["gpu"])
    shapes.setdefault(s, {}).setdefault(r["impl"], []).append(r)
  return shapes


def kernel_of(record: dict) -> KernelConfig:
  return KernelConfig(**record["kernel"])


def gemm_points(shapes) -> list[tuple[int, int, int, float]]:
  """(M, N, K, TFLOP/s) of the timeable GEMM-alone records."""
  pts = []
  for s, impls in shapes.items():
    for r in impls.get("gemm_alone", []):
      if r["median_ms"] >= MIN_DEVICE_MS:
        m, n, k = s.local_gemm
        pts.append((m, n, k, 2.0 * m * n * k / (r["median_ms"] * 1e9)))
  return pts


def _median(xs, default=0.0):
  return float(np.median(xs)) if len(xs) else default


def fit_group(shapes, gemm: cost_model.GemmModel, num_sms: int, device_kind: str, dtype: str,
              world: int, tiles: dict | None = None, latency_us: float = FLAG_LATENCY_US):
  """(GroupParams, {tile: TileCost}) fitted on the records; `tiles` given: kept, not fitted."""
  from scipy.optimize import least_squares

  curves = {"ag": [], "rs": []}
  for s, impls in shapes.items():
    for r in impls.get("unfused", []):
      curves[s.op].append((s.collective_bytes, max(r["median_ms"] - gemm.ms(*s.local_gemm), 1e-3)))
  transfers = [r["bytes"] / (r["median_ms"] * 1e6) for impls in shapes.values()
               for r in impls.get("transfer_alone", [])]
  dispatch = [r["median_ms"] for impls in shapes.values() for r in impls.get("gemm_alone", [])
              if r["median_ms"] < MIN_DEVICE_MS]
  for op in ("ag", "rs"):
    if not curves[op]:
      raise ValueError(f"fit: no unfused {op} records for {world}x {device_kind} {dtype}")
  if not transfers:
    raise ValueError(f"fit: no transfer_alone records for {world}x {device_kind} {dtype}")
  fixed = dict(ag_collective=cost_model.Curve.from_points(curves["ag"]),
               rs_collective=cost_model.Curve.from_points(curves["rs"]),
               link_gbps=max(transfers), first_chunk_latency_us=latency_us,
               unfused_floor_ms=_median(dispatch))
  ours = [(s, r) for s, impls in shapes.items() for r in impls.get("ours", [])]
  if not ours:
    raise ValueError(f"fit: no fused-kernel records for {world}x {device_kind} {dtype}")
  free = [p for p in _FUSED if not (tiles and p[0] in _TILE_PARAMS)]
  tile_names = sorted({cost_model.tile_name(kernel_of(r)) for _, r in ours})

  def build(x):
    v = dict(zip([p[0] for p in free], x))
    group = cost_model.GroupParams(**fixed, **{k: v[k] for k in v if k not in _TILE_PARAMS})
    tc = tiles or {t: cost_model.TileCost(v["kappa"], v["fixed_us"]) for t in tile_names}
    return cost_model.CostModel(device_kind, world, dtype, num_sms, gemm, tc, group)

  names = [p[0] for p in free]
  mover_prior = fixed["link_gbps"] / MOVERS_FILLING_LINK

  def residuals(x):
    m = build(x)
    prior = PRIOR_WEIGHT * math.log(x[names.index("mover_gbps_per_cta")] / mover_prior)
    return [math.log(m.fused_ms(s.op, *s.per_device, kernel_of(r)) / r["median_ms"])
            for s, r in ours] + [prior]

  x0 = [p[1] for p in free]
  x0[names.index("fused_floor_ms")] = min(r["median_ms"] for _, r in ours) * 0.9
  x0[names.index("mover_gbps_per_cta")] = mover_prior
  lower, upper = [p[2] for p in free], [p[3] for p in free]
  sol = least_squares(residuals, np.clip(x0, lower, upper), bounds=(lower, upper),
                      loss="soft_l1", f_scale=0.1)
  fitted = build(sol.x)
  return fitted.group, fitted.tiles


def one_gpu_model(gemm: cost_model.GemmModel, tiles: dict, num_sms: int, dtype: str,
                  call_us: float) -> cost_model.CostModel:
  """The model of the AG kernel on a group of one GPU: its tile loop alone (no peers)."""
  none = cost_model.Curve(((1.0, 0.0),))
  group = cost_model.GroupParams(none, none, 1.0, 1.0, 0.0, call_us, 0.0, 0.0, 0.0)
  return cost_model.CostModel("", 1, dtype, num_sms, gemm, tiles, group)


def fit_tiles(timings, gemm: cost_model.GemmModel, num_sms: int, dtype: str):
  """({tile: TileCost}, {tile: one-GPU call us}) from the AG kernel timed on one GPU alone.

  timings: [(KernelConfig, M, N, K, ms)].  Per tile shape, kappa, fixed_us and
  the call cost of a one-GPU launch, by least squares on log(pred / measured).
  """
  from scipy.optimize import least_squares
  tiles, calls = {}, {}
  for tile in sorted({cost_model.tile_name(t[0]) for t in timings}):
    mine = [t for t in timings if cost_model.tile_name(t[0]) == tile]

    def residuals(x, mine=mine, tile=tile):
      m = one_gpu_model(gemm, {tile: cost_model.TileCost(x[0], x[1])}, num_sms, dtype, x[2])
      return [math.log(m.fused_ms("ag", mm, k, n, cfg) / ms) for cfg, mm, n, k, ms in mine]

    sol = least_squares(residuals, [1.05, 2.0, 5.0], bounds=([0.7, 0.0, 0.0], [1.6, 30.0, 100.0]))
    tiles[tile] = cost_model.TileCost(float(sol.x[0]), float(sol.x[1]))
    calls[tile] = float(sol.x[2])
  return tiles, calls


def fit(records, gemm_params: dict | None = None, num_sms: int = 132,
        latency_us: float = FLAG_LATENCY_US) -> dict[str, dict]:
  """Model params (the JSON of tuning/data/model_*.json), one dict per GPU kind.

  gemm_params: single-GPU calibration output (its "gemm" part per dtype, with
  points and possibly measured tile costs) to use instead of gemm_alone records.
  """
  shapes = by_shape(records)
  groups: dict[tuple, dict] = {}
  for s, impls in shapes.items():
    groups.setdefault((s.gpu.replace("-", " "), s.world, s.dtype), {})[s] = impls
  out: dict[str, dict] = {}
  for (kind, world, dtype), sub in sorted(groups.items()):
    dates = sorted({r["date"] for impls in sub.values() for rs in impls.values() for r in rs})
    when = dates[0] if len(dates) == 1 else f"{dates[0]}..{dates[-1]}"
    calibrated = (gemm_params or {}).get("gemm", {}).get(dtype)
    if calibrated:
      gemm = cost_model.GemmModel(tuple(map(tuple, calibrated["points"])),
                                  calibrated.get("bandwidth_log2", 0.6))
      tiles = {t: cost_model.TileCost(v["kappa"], v["fixed_us"])
               for t, v in calibrated.get("tiles", {}).items()} or None
      gemm_source = calibrated.get("source", "single-GPU calibration")
    else:
      gemm, tiles = cost_model.GemmModel(tuple(gemm_points(sub))), None
      gemm_source = f"gemm_alone records of {when}"
    group, fitted_tiles = fit_group(sub, gemm, num_sms, kind, dtype, world, tiles, latency_us)
    params = out.setdefault(kind, {"format": cost_model.FORMAT, "device_kind": kind,
                                   "num_sms": num_sms, "gemm": {}, "groups": {}})
    params["gemm"][dtype] = {
        "source": gemm_source, "bandwidth_log2": gemm.bandwidth_log2,
        "points": [[*p[:3], round(p[3], 2)] for p in gemm.points],
        "tiles": {t: {"kappa": round(c.kappa, 6), "fixed_us": round(c.fixed_us, 6),
                      "source": ("calibrated on one GPU" if tiles
                                 else f"fit on {len(sub)} shapes of {when}")}
                  for t, c in fitted_tiles.items()}}
    params["groups"][cost_model.group_key(world, dtype)] = {
        "source": f"fit on {len(sub)} shapes of {when}",
        **{f.name: ([[x, round(y, 5)] for x, y in getattr(group, f.name).points]
                    if f.name.endswith("collective") else round(getattr(group, f.name), 6))
           for f in dataclasses.fields(group)}}
  return out


@dataclasses.dataclass(frozen=True)
class Check:
  """One shape of a leave-one-shape-out check: measured and predicted (ms)."""
  shape: Shape
  unfused: float
  ours: float
  config: KernelConfig        # the measured (fastest) config of ours
  unfused_pred: float
  ours_pred: float            # the model at the measured config
  best_pred: float            # the model's fastest config
  best_config: KernelConfig

  @property
  def measured_fused_wins(self) -> bool:
    return self.ours < self.unfused

  @property
  def predicted_fused_wins(self) -> bool:
    return self.best_pred < self.unfused_pred

  @property
  def decisive(self) -> bool:
    """The measured difference exceeds 3 % (the verdict is compared only where it does)."""
    return abs(self.ours - self.unfused) / min(self.ours, self.unfused) > 0.03

  @property
  def ours_error(self) -> float:
    return self.ours_pred / self.ours - 1


def predict_checks(params: dict, shape: Shape, impls: dict) -> Check:
  from jax_autooverlap.tuning import select
  m = cost_model.from_params(params, shape.world, shape.dtype)
  best_rec = min(impls["ours"], key=lambda r: r["median_ms"])
  cfg = kernel_of(best_rec)
  rows, k, cols = shape.per_device
  configs = [c for c in select.candidate_configs(shape.op, m, shape.dtype)
             if select.unsupported(rows if shape.op == "ag" else rows // shape.world, k, cols,
                                   shape.dtype, shape.dtype, c, shape.op) is None]
  best_ms, best_cfg = m.rank(shape.op, rows, k, cols, configs)[0]
  return Check(shape, _median([r["median_ms"] for r in impls["unfused"]]), best_rec["median_ms"],
               cfg, m.unfused_ms(shape.op, rows, k, cols), m.fused_ms(shape.op, rows, k, cols, cfg),
               best_ms, best_cfg)


def leave_one_shape_out(records, **fit_kwargs) -> list[Check]:
  """Fit without each shape in turn (all of its records), then predict that shape."""
  shapes = by_shape(records)
  checks = []
  for s, impls in sorted(shapes.items(), key=lambda kv: (kv[0].op, kv[0].m, kv[0].k, kv[0].n)):
    if "ours" not in impls or "unfused" not in impls:
      continue
    rest = [r for t, i in shapes.items() if t != s for rs in i.values() for r in rs]
    params = fit(rest, **fit_kwargs)[s.gpu.replace("-", " ")]
    checks.append(predict_checks(params, s, impls))
  return checks


def summary(checks: list[Check]) -> dict:
  decisive = [c for c in checks if c.decisive]
  agree = int(sum(c.measured_fused_wins == c.predicted_fused_wins for c in decisive))
  return {"shapes": len(checks), "decisive": len(decisive), "verdicts_agree": agree,
          "verdict_agreement": agree / len(decisive) if decisive else float("nan"),
          "median_abs_error_ours": float(np.median([abs(c.ours_error) for c in checks])),
          "median_abs_error_unfused": float(np.median([abs(c.unfused_pred / c.unfused - 1)
                                                       for c in checks]))}


def table(checks: list[Check]) -> str:
  """Markdown table of a leave-one-shape-out check."""
  head = ("| shape M×K×N | unfused meas | unfused pred | ours meas (config) | ours pred | "
          "error | model's best config (pred) | verdict meas / pred |\n"
          "|---|---|---|---|---|---|---|---|")
  rows = []
  for c in checks:
    cfg = lambda k: f"c{k.chunks}" + (f" m{k.num_comm}" if c.shape.op == "ag" else "")
    verdict = lambda fused: "fused" if fused else "unfused"
    rows.append(f"| {c.shape.name} | {c.unfused:.3f} | {c.unfused_pred:.3f} | {c.ours:.3f} "
                f"({cfg(c.config)}) | {c.ours_pred:.3f} | {c.ours_error * 100:+.1f} % | "
                f"{cfg(c.best_config)} ({c.best_pred:.3f}) | {verdict(c.measured_fused_wins)} / "
                f"{verdict(c.predicted_fused_wins)}{'' if c.decisive else ' (within 3 %)'} |")
  return "\n".join([head] + rows)


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m jax_autooverlap.tuning.fit")
  ap.add_argument("--records", nargs="+", default=["bench/records"],
                  help="record JSON files or directories of them (default: %(default)s)")
  ap.add_argument("--gemm", help="single-GPU calibration JSON (its GEMM points and tile costs)")
  ap.add_argument("--num-sms", type=int, default=132)
  ap.add_argument("--out", help="write the params of the (single) GPU kind here")
  ap.add_argument("--check", action="store_true", help="leave-one-shape-out table and summary")
  args = ap.parse_args(argv)
  records = load_records(args.records)
  gemm = json.loads(pathlib.Path(args.gemm).read_text()) if args.gemm else None
  kw = dict(gemm_params=gemm, num_sms=args.num_sms)
  params = fit(records, **kw)
  if args.out:
    if len(params) != 1:
      print(f"fit: records hold {len(params)} GPU kinds; --out takes one", file=sys.stderr)
      return 2
    from jax_autooverlap.tuning.store import write_json_atomic
    (p,) = params.values()
    # the files read, not the directories: a record committed later does not change what the
    # shipped parameters are the fit of (tests/test_cost_model.py re-fits from these)
    inputs = {"records": [f.as_posix() for f in record_files(args.records)], "gemm": args.gemm}
    write_json_atomic(pathlib.Path(args.out), {**p, "fit_inputs": inputs,
                                               "written": datetime.date.today().isoformat()})
    print(f"wrote {args.out}")
  else:
    print(json.dumps(params, indent=1))
  if args.check:
    checks = leave_one_shape_out(records, **kw)
    print(table(checks))
    print(json.dumps(summary(checks), indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
