"""Cost model of the fused ops and of the unfused program, per (GPU kind, group size, dtype).

Times are per call of back-to-back calls (what the benchmark measures), in ms.
Sizes are per device, as the tuner sees them:
  ag (all_gather(a, rows) @ b):   a[rows, k] gathered over `world`, b[k, cols]
  rs (psum_scatter(a @ b, rows)): a[rows, k], b[k, cols] -> [rows / world, cols]

Unfused program = collective (time against bytes, a measured curve) + cuBLAS
GEMM (measured TFLOP/s at measured shapes, smoothed in log2(M, N, K) space).

Fused kernel (one config) = a fluid schedule of output tiles over the SMs:
  - a tile costs `fixed_us` + its k-steps at `kappa` x cuBLAS's time per flop
    at the same GEMM shape (the kernel's main loop against cuBLAS, per tile shape),
  - AG: `num_comm` mover CTAs push the shard at min(num_comm x per-CTA push
    bandwidth, link bandwidth), holding their SMs until done; remote tiles of a
    GROUP_M tile-row group start when the chunks holding their rows have arrived
    (plus the flag latency); local tiles first,
  - RS: remote tiles first, each pushed into its owner (`rs_exchange_us_per_kib`
    per tile), then own tiles, each reading and summing every peer's partial
    (the same cost per peer), released as the peers' chunks arrive,
  - never fewer than ceil(tiles / SMs) tile times (wave quantisation),
  - plus a per-call cost (launch, end-of-call barrier, skew between the GPUs),
and a call never costs less than `fused_floor_ms` (host dispatch of a program
with the kernel, which bounds small calls).

The parameters are data (tuning/data/model_*.json and the user's cache,
written by `python -m jax_autooverlap.bench calibrate` and by tuning/fit.py);
nothing here is specific to one GPU.

Where no parameters were measured for a (GPU kind, group size), the model is
derived (`CostModel.derived` says which parameters, and ao.explain shows it):
  - another group size on NVSwitch nodes: a GPU's link bandwidth does not
    depend on how many peers share it, and the collective curves are per byte
    received (each GPU receives (w-1)/w of the gathered data, sends (w-1)/w of
    what it scatters), so the curves and link bandwidth carry over, plus a ring
    step's latency (`HOP_US`) per extra peer; the fused kernels' push and
    exchange terms already count (w-1) peers' bytes;
  - another Hopper part: from a calibrated kind (NVIDIA H200 ships) scaled by
    device properties (`DeviceProps`: SMs x SM clock for compute-bound GEMMs,
    memory bandwidth for memory-bound ones, NVLink bandwidth for every
    transfer), read from the device where the caller can (SMs, clocks, memory
    bus), else from `HOPPER` (the vendors' data sheets).
A derived model extrapolates: the planner uses it to rank and prune the
candidates of the first-call measurement and for explain's prediction, never
as the final word on fused vs unfused (tuning/select.py).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib

import numpy as np

from jax_autooverlap.tuning import store
from jax_autooverlap.tuning.config import KernelConfig

FORMAT = 1
MAX_CHUNKS = 64  # arrival counters per peer in the workspace (runtime/workspace.py MAX_CHUNKS)
# One more ring step of NCCL's collectives per extra peer: the order of a cross-GPU flag round
# trip measured on 2xH200 (5-8 us, docs/NOTES.md).  An assumption, not fitted.
HOP_US = 5.0
# Dense tensor-core flops per SM per clock on Hopper (sm_90), by operand size in bytes:
# 989 TFLOP/s bf16 = 132 SMs x 4096 x 1.83 GHz (H100/H200 SXM data sheets).
FLOPS_PER_SM_CLOCK = {1: 8192, 2: 4096, 4: 2048}


@dataclasses.dataclass(frozen=True)
class DeviceProps:
  """What the derivation of another Hopper part's model scales by; `source` says where each
  value comes from ("device" or "table")."""
  num_sms: int
  clock_mhz: float     # SM boost clock
  memory_gbps: float   # HBM bandwidth
  nvlink_gbps: float   # NVLink bandwidth per GPU per direction (through NVSwitch to any peer)
  source: str = "table"


# Hopper parts of NVSwitch nodes (HGX / DGX boards, GH200 NVL systems), as CUDA names them
# (jax's device_kind): SMs, SM boost clock, memory bandwidth, NVLink per direction.  From the
# vendors' data sheets; PCIe and NVL cards are left out (their NVLink bridges join pairs only).
HOPPER = {
    "NVIDIA H200": DeviceProps(132, 1980, 4800, 450),
    "NVIDIA H100 80GB HBM3": DeviceProps(132, 1980, 3350, 450),
    "NVIDIA H800": DeviceProps(132, 1980, 3350, 200),
    "NVIDIA H20": DeviceProps(78, 1980, 4000, 450),
    "NVIDIA GH200 480GB": DeviceProps(132, 1980, 4000, 450),
    "NVIDIA GH200 144G HBM3e": DeviceProps(132, 1980, 4900, 450),
}
# The calibrated kind other Hopper parts are derived from.
BASE_KIND = "NVIDIA H200"


def tile_name(cfg: KernelConfig) -> str:
  return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}"


def tiles_per_chunk(tile_rows: int, chunks: int) -> int:
  """Tile rows per arrival chunk of a shard of tile_rows row tiles: `chunks` chunks, but never
  more than the workspace's MAX_CHUNKS counters per peer (what the launchers pass the kernels,
  backends/launch.py, and what the model times)."""
  return max(math.ceil(tile_rows / min(chunks, tile_rows)), math.ceil(tile_rows / MAX_CHUNKS))


@dataclasses.dataclass(frozen=True)
class Curve:
  """Time (ms) against size (bytes), piecewise linear through measured points.

  Below the smallest size: the smallest size's time (latency-bound).  Above the
  largest: its time plus the extra bytes at the bandwidth of the last segment
  (or at the largest size's average bandwidth, where noise made that segment flat).
  """
  points: tuple[tuple[float, float], ...]

  @classmethod
  def from_points(cls, points) -> "Curve":
    by_size: dict[float, list[float]] = {}
    for x, y in points:
      by_size.setdefault(float(x), []).append(float(y))
    if not by_size:
      raise ValueError("Curve: no points")
    return cls(tuple((x, float(np.median(ys))) for x, ys in sorted(by_size.items())))

  def __call__(self, x: float) -> float:
    xs = [p[0] for p in self.points]
    ys = [p[1] for p in self.points]
    if x <= xs[0]:
      return ys[0]
    if x >= xs[-1]:
      if len(xs) == 1:
        return ys[0] * x / xs[0]
      slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
      slope = slope if slope > 0 else ys[-1] / xs[-1]
      return ys[-1] + slope * (x - xs[-1])
    return float(np.interp(x, xs, ys))


@dataclasses.dataclass(frozen=True)
class GemmModel:
  """cuBLAS GEMM (jnp.dot) on one GPU: TFLOP/s measured at (M, N, K) points.

  The rate at a shape is the Gaussian-weighted mean of the measured rates in
  log2(M, N, K) space (`bandwidth_log2` wide), so it interpolates between
  measured shapes and takes the nearest ones' rate outside them.
  """
  points: tuple[tuple[int, int, int, float], ...]
  bandwidth_log2: float = 0.6

  def __post_init__(self):
    if not self.points:
      raise ValueError("GemmModel: no measured points")

  @functools.cached_property
  def _arrays(self):
    pts = np.asarray(self.points, np.float64)
    return np.log2(pts[:, :3]), pts[:, 3]

  def tflops(self, m: int, n: int, k: int) -> float:
    logs, rates = self._arrays
    d2 = np.sum((logs - np.log2([m, n, k])) ** 2, axis=1)
    w = np.exp(-(d2 - d2.min()) / (2 * self.bandwidth_log2 ** 2))
    return float(np.sum(w * rates) / np.sum(w))

  def ms(self, m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k / (self.tflops(m, n, k) * 1e9)


@dataclasses.dataclass(frozen=True)
class TileCost:
  """The fused kernels' GEMM for one tile shape, relative to cuBLAS at the same GEMM shape."""
  kappa: float     # time per flop of a k-step / cuBLAS's
  fixed_us: float  # per tile: pipeline fill, epilogue, tile counter


@dataclasses.dataclass(frozen=True)
class GroupParams:
  """What needs a group of GPUs: collectives, peer links, the fused kernels' fixed costs."""
  ag_collective: Curve           # all-gather (NCCL, in XLA): ms against bytes received per device
  rs_collective: Curve           # reduce-scatter: ms against bytes sent per device
  link_gbps: float               # peer-to-peer bandwidth per direction (copy engine, largest)
  mover_gbps_per_cta: float      # in-kernel push bandwidth of one AG mover CTA
  rs_exchange_us_per_kib: float  # RS: SM time per KiB of a tile pushed to / read from a peer
  call_us: float                 # fused call: launch, final barrier, skew between GPUs
  first_chunk_latency_us: float  # flag round trip before a pushed chunk is seen by the peer
  fused_floor_ms: float          # per-call host floor of a program holding a fused kernel
  unfused_floor_ms: float        # per-call host floor of a plain multi-GPU program


@dataclasses.dataclass(frozen=True)
class CostModel:
  device_kind: str
  world: int
  dtype: str
  num_sms: int
  gemm: GemmModel
  tiles: dict  # tile name ("128x256x64") -> TileCost
  group: GroupParams
  source: str = ""       # where the group's parameters come from (shown by ao.explain)
  gemm_source: str = ""  # where the single-GPU GEMM part comes from
  derived: tuple = ()    # what is derived, not measured (empty: fit on this kind and group)

  @property
  def extrapolated(self) -> bool:
    """Some parameters were derived for this GPU kind or group size, not measured on it."""
    return bool(self.derived)

  # --- the unfused program ---------------------------------------------------

  def unfused_ms(self, op: str, rows: int, k: int, cols: int,
                 out_itemsize: int | None = None) -> float:
    w, item = self.world, np.dtype(self.dtype).itemsize
    out_item = out_itemsize or item
    if op == "ag":
      device = self.group.ag_collective((w - 1) * rows * k * item) + self.gemm.ms(w * rows, cols, k)
    else:
      device = self.gemm.ms(rows, cols, k) + self.group.rs_collective(
          (w - 1) * (rows // w) * cols * out_item)
    return max(self.group.unfused_floor_ms, device)

  # --- the fused kernels -----------------------------------------------------

  def supports(self, cfg: KernelConfig) -> bool:
    return tile_name(cfg) in self.tiles

  def _tile_us(self, cfg: KernelConfig, m: int, n: int, k: int) -> float:
    tile = self.tiles[tile_name(cfg)]
    per_sm_flops_per_us = self.gemm.tflops(m, n, k) * 1e6 / self.num_sms
    step_us = 2.0 * cfg.block_m * cfg.block_n * cfg.block_k / per_sm_flops_per_us * tile.kappa
    return tile.fixed_us + math.ceil(k / cfg.block_k) * step_us

  def fused_ms(self, op: str, rows: int, k: int, cols: int, cfg: KernelConfig,
               out_itemsize: int | None = None) -> float:
    if not self.supports(cfg):
      raise ValueError(f"cost model {self.source!r} has no tile cost for {tile_name(cfg)} tiles "
                       f"(has {sorted(self.tiles)})")
    us = (self._ag_us(rows, k, cols, cfg) if op == "ag"
          else self._rs_us(rows, k, cols, cfg, out_itemsize or np.dtype(self.dtype).itemsize))
    return max(self.group.fused_floor_ms, (us + self.group.call_us) / 1e3)

  def _chunks(self, tile_rows: int, cfg: KernelConfig):
    """(tile rows per arrival chunk, chunks) of a shard of tile_rows row tiles."""
    per_chunk = tiles_per_chunk(tile_rows, cfg.chunks)
    return per_chunk, math.ceil(tile_rows / per_chunk)

  def _ag_us(self, m: int, k: int, n: int, cfg: KernelConfig) -> float:
    w, sms, g = self.world, self.num_sms, self.group
    tm, tn = math.ceil(m / cfg.block_m), math.ceil(n / cfg.block_n)
    per_chunk, nchunks = self._chunks(tm, cfg)
    movers = max(1, min(cfg.num_comm, sms // 2))
    tile = self._tile_us(cfg, w * m, n, k)
    push_bytes = (w - 1) * m * k * np.dtype(self.dtype).itemsize
    push_us = push_bytes / (min(movers * g.mover_gbps_per_cta, g.link_gbps) * 1e3)

    def arrival(tile_row):  # chunks are pushed to every peer in order, chunk-major
      return g.first_chunk_latency_us + (tile_row // per_chunk + 1) / nchunks * push_us

    blocks = [(0.0, tm * tn * tile)]  # local shard: no wait
    for _ in range(w - 1):
      for first in range(0, tm, cfg.group_m):  # tiles go out GROUP_M tile rows at a time
        last = min(first + cfg.group_m, tm) - 1
        blocks.append((arrival(last), (last - first + 1) * tn * tile))
    capacity = [(push_us, sms - movers), (math.inf, sms)]
    done = _fluid(blocks, capacity)
    return max(done, math.ceil(w * tm * tn / sms) * tile)

  def _rs_us(self, m: int, k: int, n: int, cfg: KernelConfig, out_item: int) -> float:
    w, sms, g = self.world, self.num_sms, self.group
    tm, tn = math.ceil(m // w / cfg.block_m), math.ceil(n / cfg.block_n)
    per_chunk, _ = self._chunks(tm, cfg)
    tile = self._tile_us(cfg, m, n, k)
    exchange = g.rs_exchange_us_per_kib * cfg.block_m * cfg.block_n * out_item / 1024
    remote_work = (w - 1) * tm * tn * (tile + exchange)
    push_bytes = (w - 1) * (m // w) * n * out_item
    remote_us = max(remote_work / sms, push_bytes / (g.link_gbps * 1e3))

    def pushed(tile_row):  # when a peer has pushed the tile-row group holding this row
      group_end = min((tile_row // cfg.group_m + 1) * cfg.group_m, tm)
      return group_end / tm * remote_us

    def arrival(tile_row):  # the whole chunk holding this row, from every peer
      last = min((tile_row // per_chunk + 1) * per_chunk, tm) - 1
      return g.first_chunk_latency_us + pushed(last)

    blocks = [(0.0, remote_work)]
    for first in range(0, tm, cfg.group_m):
      last = min(first + cfg.group_m, tm) - 1
      need = max(arrival(r) for r in range(first, last + 1))
      blocks.append((need, (last - first + 1) * tn * (tile + (w - 1) * exchange)))
    done = _fluid(blocks, [(math.inf, sms)])
    return max(done, math.ceil(w * tm * tn / sms) * tile)

  def rank(self, op: str, rows: int, k: int, cols: int, configs, out_itemsize=None):
    """[(predicted ms, config)] of the configs this model covers, fastest first.

    Predictions equal to 0.1 us rank in the order given (configs the model
    cannot tell apart keep the caller's preference).
    """
    scored = [(self.fused_ms(op, rows, k, cols, c, out_itemsize), i, c)
              for i, c in enumerate(configs) if self.supports(c)]
    return [(ms, c) for ms, _, c in sorted(scored, key=lambda s: (round(s[0], 4), s[1]))]


def _fluid(blocks, capacity) -> float:
  """Finish time (us) of work blocks run in order on SMs, each not before its release.

  blocks: [(release_us, SM-us of work)]; capacity: [(until_us, SMs)] piecewise
  constant, the last piece unbounded.  Work is fluid: any number of SMs share it.
  """
  t = 0.0
  for release, work in blocks:
    t = max(t, release)
    for until, sms in capacity:
      if t >= until:
        continue
      if t + work / sms <= until:
        t += work / sms
        work = 0.0
        break
      work -= (until - t) * sms
      t = until
  return t


# --- parameters on disk ------------------------------------------------------

def group_key(world: int, dtype) -> str:
  return f"w{world}|{np.dtype(dtype).name}"


def params_path(directory: pathlib.Path, device_kind: str) -> pathlib.Path:
  return directory / f"model_{device_kind.replace(' ', '-')}.json"


def merge_params(base: dict, new: dict) -> dict:
  """`new` over `base`, per dtype section of the GEMM part and per group (the newest wins)."""
  out = {**base, **{k: v for k, v in new.items() if k not in ("gemm", "groups")}}
  for part in ("gemm", "groups"):
    out[part] = {**base.get(part, {}), **new.get(part, {})}
  return out


@functools.cache
def _all_params() -> dict:
  """device kind -> params, shipped ones then the user's calibration (read once per process)."""
  out: dict[str, dict] = {}
  for path in store.model_param_files():
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
      continue
    kind = data["device_kind"]
    out[kind] = merge_params(out.get(kind, {}), data)
  return out


def clear_cache():
  _all_params.cache_clear()
  load.cache_clear()


def _model(params: dict, world: int, name: str, group: dict, source: str,
           derived: tuple = ()) -> CostModel:
  gemm = params["gemm"][name]
  return CostModel(
      device_kind=params["device_kind"], world=world, dtype=name, num_sms=int(params["num_sms"]),
      gemm=GemmModel(tuple(tuple(p) for p in gemm["points"]), gemm.get("bandwidth_log2", 0.6)),
      tiles={t: TileCost(v["kappa"], v["fixed_us"]) for t, v in gemm["tiles"].items()},
      group=GroupParams(**{f.name: (Curve.from_points(group[f.name])
                                    if f.name.endswith("collective") else float(group[f.name]))
                           for f in dataclasses.fields(GroupParams)}),
      source=source, gemm_source=gemm.get("source", "?"), derived=derived)


def other_group_size(group: dict, fit_world: int, world: int) -> dict:
  """A group's parameters for `world` GPUs on NVSwitch from those fit on `fit_world` (module
  docstring): the collective curves shifted by a ring step per extra peer, the rest kept."""
  shift = (world - fit_world) * HOP_US / 1e3
  out = dict(group)
  for part in ("ag_collective", "rs_collective"):
    out[part] = [[b, max(t + shift, 1e-4)] for b, t in group[part]]
  return out


def from_params(params: dict, world: int, dtype) -> CostModel | None:
  """The model of (world, dtype) from one device kind's params, or None where a part is missing.

  A group size without fitted parameters is derived from the nearest one fitted (same dtype).
  """
  name = np.dtype(dtype).name
  gemm = params.get("gemm", {}).get(name)
  if gemm is None or not gemm.get("tiles"):
    return None
  groups = params.get("groups", {})
  group = groups.get(group_key(world, name))
  if group is not None:
    return _model(params, world, name, group, f"params {group.get('source', '?')}")
  fitted = sorted((abs(int(k.split("|")[0][1:]) - world), int(k.split("|")[0][1:]))
                  for k in groups if k.endswith("|" + name))
  if not fitted:
    return None
  fit_world = fitted[0][1]
  base = groups[group_key(fit_world, name)]
  return _model(params, world, name, other_group_size(base, fit_world, world),
                f"params {base.get('source', '?')} for {fit_world} GPUs, derived for {world}",
                (f"group of {world} from the fit on {fit_world} GPUs (NVSwitch: same link "
                 f"bandwidth per GPU, +{HOP_US:g} us per ring step)",))


def other_hopper(params: dict, device_kind: str, props: DeviceProps,
                 base_props: DeviceProps) -> dict:
  """Params of another Hopper part from a calibrated kind's, scaled by device properties."""
  compute = (base_props.num_sms * base_props.clock_mhz) / (props.num_sms * props.clock_mhz)
  memory = base_props.memory_gbps / props.memory_gbps
  link = props.nvlink_gbps / base_props.nvlink_gbps
  clock = props.clock_mhz / base_props.clock_mhz
  out = {**params, "device_kind": device_kind, "num_sms": props.num_sms, "gemm": {}, "groups": {}}
  for name, gemm in params.get("gemm", {}).items():
    item = np.dtype(name).itemsize
    peak = base_props.num_sms * FLOPS_PER_SM_CLOCK.get(item, 4096) * base_props.clock_mhz * 1e6
    points = []
    for m, n, k, tflops in gemm["points"]:
      flops = 2.0 * m * n * k
      moved = (m * k + k * n + m * n) * item
      # roofline of the calibrated kind: which bound the point sits nearer to scales its time
      scale = compute if flops / peak >= moved / (base_props.memory_gbps * 1e9) else memory
      points.append([m, n, k, tflops / scale])
    out["gemm"][name] = {**gemm, "points": points,
                         "source": f"{gemm.get('source', '?')}, scaled to {device_kind}"}
  for key, group in params.get("groups", {}).items():
    g = dict(group)
    for part in ("ag_collective", "rs_collective"):  # t_X(bytes) = t_base(bytes / link)
      g[part] = [[b * link, t] for b, t in group[part]]
    g["link_gbps"] = group["link_gbps"] * link
    g["mover_gbps_per_cta"] = group["mover_gbps_per_cta"] * clock
    g["rs_exchange_us_per_kib"] = group["rs_exchange_us_per_kib"] / clock
    out["groups"][key] = g
  return out


def _derived_kind_note(device_kind: str, props: DeviceProps, base: str) -> str:
  return (f"{device_kind} from {base}'s calibration scaled by {props.source} properties "
          f"({props.num_sms} SMs, {props.clock_mhz:g} MHz, {props.memory_gbps:g} GB/s memory, "
          f"{props.nvlink_gbps:g} GB/s NVLink)")


def device_props(device_kind: str, read: DeviceProps | None = None) -> DeviceProps | None:
  """The kind's properties: what was read from the device (NVLink bandwidth, which the device
  does not report here, from the table), else the table's, else None."""
  table = HOPPER.get(device_kind)
  if read is None:
    return table
  if table is None:
    return None  # no NVLink bandwidth known: no derivation
  return dataclasses.replace(read, nvlink_gbps=table.nvlink_gbps,
                             source="device (NVLink from the table)")


@functools.cache
def load(device_kind: str, world: int, dtype, props: DeviceProps | None = None) -> CostModel | None:
  """The cost model for this GPU kind, group size and dtype, or None (never calibrated, not
  derivable).  `props`: the device's properties as read by the caller (for derivation)."""
  all_params = _all_params()
  params = all_params.get(device_kind)
  if params is not None:
    return from_params(params, world, dtype)
  mine, base_props = device_props(device_kind, props), HOPPER.get(BASE_KIND)
  base = all_params.get(BASE_KIND)
  if mine is None or base is None or base_props is None:
    return None
  model = from_params(other_hopper(base, device_kind, mine, base_props), world, dtype)
  if model is None:
    return None
  note = _derived_kind_note(device_kind, mine, BASE_KIND)
  return dataclasses.replace(model, derived=(note, *model.derived),
                             source=f"{model.source}; derived for {device_kind}")
