"""Per-tile timelines of the Gluon kernels (kernels/gluon_trace.py): from clock stamps to times.

A trace is int64 [ctas, 1 + SLOTS, FIELDS] as the kernels write it (FIELDS 6; traces
recorded before 2026-12-05 have 4: no PARTS_IN and PUSHED stamps).  `tiles` turns it into one
record per tile in ns on a common time base (each CTA's %clock64 scaled by the clock rate
seen between its two %globaltimer reads, anchored at the first); `frames` into one record per
CTA of when its consumers started and ended and, where the kernel stamps them (the Gluon
kernels' FRAME row), when the kernel's first and last statements ran; `summarize` into what
the loopback benchmark prints: per tile the main loop, the epilogue and the gap before the
next tile (the consumers waiting for its number or its first stage), where the tl kernels
stamp them the epilogue's steps (a split part's wait for the tile's other parts, split into
the parts' skew and the last part's release, the sum of the parts and the push to the peers,
the own rows' wait and sum), per CTA the lead (start
to first tile) and its end, for the CTA that ends last (which sets the kernel's time) where
its time went, and the time before and after the consumers (set-up, the partitions' join,
finish_call).
"""
from __future__ import annotations

import numpy as np


def frames(trace: np.ndarray) -> list[dict]:
  """[{cta, start, end, entry, exit, ghz, ns}] of every CTA that finished recording: its
  consumers' start and end and (None where not stamped) the kernel's first and last statement,
  in ns from the first CTA's start; ghz: its SM clock over the kernel (cycles per ns); ns: its
  %clock64 -> ns on that base."""
  trace = np.asarray(trace, np.int64)
  started = trace[:, 0, 0][trace[:, 0, 0] > 0]
  base = int(started.min()) if started.size else 0  # %globaltimer (~1.8e18 ns) is too large for
  out = []                                          # float64 to hold to the ns: times from base
  for cta, rows in enumerate(trace):
    gt0, clk0, gt1, clk1 = (int(x) for x in rows[0][:4])
    if gt1 <= gt0 or clk1 <= clk0:  # the CTA did not finish recording: skip it
      continue
    rate = (clk1 - clk0) / (gt1 - gt0)  # cycles per ns
    ns = lambda clk, gt0=gt0 - base, clk0=clk0, rate=rate: gt0 + (int(clk) - clk0) / rate
    entry, exit_ = (int(x) for x in rows[-1][:2])  # the FRAME row (zeros: not stamped)
    out.append({"cta": cta, "start": gt0 - base, "end": ns(clk1), "ghz": rate, "ns": ns,
                "entry": ns(entry) if entry else None, "exit": ns(exit_) if exit_ else None})
  return out


def tiles(trace: np.ndarray) -> list[dict]:
  """[{cta, j, tile, got, main_done, epilogue_done, parts_in, pushed, start, end, ghz}] of every
  recorded tile: ns from the first CTA's start (parts_in, pushed: None where not stamped,
  kernels/tl_trace.py); ghz: its CTA's SM clock over the kernel (cycles per ns).  Rows 1 to
  the last but one (the last is the FRAME row: frames)."""
  trace = np.asarray(trace, np.int64)
  out = []
  for f in frames(trace):
    for j, row in enumerate(trace[f["cta"], 1:-1]):
      t, got, main, epi = row[:4]
      if got == 0:
        break
      ns = f["ns"]
      parts_in, pushed = (ns(x) if x else None for x in row[4:6]) if len(row) >= 6 else (None,) * 2
      out.append({"cta": f["cta"], "j": j, "tile": int(t), "start": f["start"], "end": f["end"],
                  "ghz": f["ghz"], "got": ns(got), "main_done": ns(main),
                  "epilogue_done": ns(epi), "parts_in": parts_in, "pushed": pushed})
  return out


# the epilogue steps summarize reports: epilogue_steps', then parts_wait_steps' split of
# parts_wait
STEPS = ("parts_wait", "push", "own", "skew", "release")


def epilogue_steps(r: dict) -> dict:
  """A tile's epilogue (ns) in the steps its kernel stamped: parts_wait (main loop's end to the
  other parts' arrival), push (to the peers' rows pushed and signalled, from the parts' arrival
  or the main loop's end), own (the rest: GEMM+RS's own rows' wait and sum; the AG's sum of
  the parts' rows and their store); {} where none is."""
  out = {}
  at = r["main_done"]
  if r["parts_in"] is not None:
    out["parts_wait"], at = r["parts_in"] - at, r["parts_in"]
  if r["pushed"] is not None:
    out["push"], at = r["pushed"] - at, r["pushed"]
  if out:
    out["own"] = r["epilogue_done"] - at
  return out


def parts_wait_steps(recs: list[dict], split_k: int) -> dict[tuple, dict]:
  """{(cta, j): {skew, release}} (ns) of the Spread split parts (the units with a PARTS_IN
  stamp: every tile split, unit u = tile * split_k + part, kernels/split_k.py): skew, from this
  part's main-loop end to the last one among its tile's recorded parts; release, from that
  last end to this part's PARTS_IN (the last part's partial stored and counted, this part's
  poll seeing it).  skew + release = the part's parts_wait."""
  by_tile: dict[int, list] = {}
  for r in recs:
    if r["parts_in"] is not None:
      by_tile.setdefault(r["tile"] // split_k, []).append(r)
  out = {}
  for parts in by_tile.values():
    last = max(r["main_done"] for r in parts)
    for r in parts:
      out[r["cta"], r["j"]] = {"skew": last - r["main_done"], "release": r["parts_in"] - last}
  return out


def summarize(trace: np.ndarray, kind=None, split_k: int = 1) -> dict:
  """Medians and sums in µs; kind(tile) -> label splits the per-tile numbers (e.g. own/remote);
  split_k: the tl config's (Spread's parts_wait split into skew and release: parts_wait_steps)."""
  recs = tiles(trace)
  if not recs:
    return {"ctas": 0}
  t0 = min(r["start"] for r in recs)
  by_cta: dict[int, list] = {}
  for r in recs:
    by_cta.setdefault(r["cta"], []).append(r)
  us = lambda x: round(float(x) / 1e3, 3)
  # the SM clock during the kernel: under the power cap it sits well below what nvidia-smi's
  # coarse samples between kernels report
  out = {"ctas": len(by_cta), "tiles": len(recs),
         "sm_clock_ghz": round(float(np.median([rs[0]["ghz"] for rs in by_cta.values()])), 3),
         "tiles_per_cta": [min(map(len, by_cta.values())), max(map(len, by_cta.values()))]}
  parts = parts_wait_steps(recs, split_k) if split_k > 1 else {}
  steps_of = lambda r: epilogue_steps(r) | parts.get((r["cta"], r["j"]), {})
  groups = {}
  for r in recs:
    groups.setdefault(kind(r["tile"]) if kind else "all", []).append(r)
  for label, rs in sorted(groups.items()):
    out[f"main_us[{label}]"] = us(np.median([r["main_done"] - r["got"] for r in rs]))
    out[f"epilogue_us[{label}]"] = us(np.median([r["epilogue_done"] - r["main_done"] for r in rs]))
    steps = [steps_of(r) for r in rs]
    for step in STEPS:
      xs = [st[step] for st in steps if step in st]
      if xs:
        out[f"{step}_us[{label}]"] = us(np.median(xs))
  gaps = [b["got"] - a["epilogue_done"] for rs in by_cta.values() for a, b in zip(rs, rs[1:])]
  out["gap_us_median"] = us(np.median(gaps)) if gaps else None
  out["gap_us_max"] = us(max(gaps)) if gaps else None
  leads = [rs[0]["got"] - t0 for rs in by_cta.values()]
  out["first_tile_at_us"] = [us(min(leads)), us(np.median(leads)), us(max(leads))]
  ends = [rs[-1]["epilogue_done"] - t0 for rs in by_cta.values()]
  out["last_epilogue_at_us"] = [us(min(ends)), us(np.median(ends)), us(max(ends))]
  last = max(by_cta.values(), key=lambda rs: rs[-1]["epilogue_done"])
  out["last_cta"] = {
      "tiles": len(last),
      "first_tile_at_us": us(last[0]["got"] - t0),
      "main_us_sum": us(sum(r["main_done"] - r["got"] for r in last)),
      "epilogue_us_sum": us(sum(r["epilogue_done"] - r["main_done"] for r in last)),
      "gap_us_sum": us(sum(b["got"] - a["epilogue_done"] for a, b in zip(last, last[1:]))),
      "end_at_us": us(last[-1]["epilogue_done"] - t0)}
  for step in STEPS:
    xs = [st[step] for st in map(steps_of, last) if step in st]
    if xs:
      out["last_cta"][f"{step}_us_sum"] = us(sum(xs))
  stamped = [f for f in frames(trace) if f["entry"] is not None and f["exit"] is not None]
  if stamped:  # before and after the consumers: set-up; the partitions' join and finish_call
    spread = lambda xs: [us(min(xs)), us(np.median(xs)), us(max(xs))]
    out["entry_to_consumers_us"] = spread([f["start"] - f["entry"] for f in stamped])
    out["consumers_to_exit_us"] = spread([f["exit"] - f["end"] for f in stamped])
    out["kernel_span_us"] = us(max(f["exit"] for f in stamped) - min(f["entry"] for f in stamped))
  return out
