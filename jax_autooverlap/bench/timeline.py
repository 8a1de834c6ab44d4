"""Per-tile timelines of the Gluon kernels (kernels/gluon_trace.py): from clock stamps to times.

A trace is int64 [ctas, 1 + SLOTS + ROUNDS, 4] as the kernels write it (older runs: no round
rows).  `tiles` turns it into one record per tile in ns on a common time base (each CTA's
%clock64 scaled by the clock rate seen between its two %globaltimer reads, anchored at the
first), `rounds` into one per round of a GEMM+RS own tile's sum (one peer's partial);
`summarize` into what the loopback benchmark prints: per tile the main loop, the epilogue and
the gap before the next tile (the consumers waiting for its number or its first stage), per
CTA the lead (start to first tile) and its end, for the CTA that ends last (which sets the
kernel's time) where its time went, and where a round's time goes (its wait, the TMA load's
issue, the load's arrival, the add).
"""
from __future__ import annotations

import numpy as np


SLOTS = 256  # kernels/gluon_trace.py's SLOTS (tests/test_loopback.py checks it)


def _clocks(trace: np.ndarray):
  """(cta, its rows, ns(clock), its rate in cycles per ns, its start and end in ns) of every CTA
  that finished recording, ns from the first CTA's start."""
  trace = np.asarray(trace, np.int64)
  started = trace[:, 0, 0][trace[:, 0, 0] > 0]
  base = int(started.min()) if started.size else 0  # %globaltimer (~1.8e18 ns) is too large for
  for cta, rows in enumerate(trace):                # float64 to hold to the ns: times from base
    gt0, clk0, gt1, clk1 = (int(x) for x in rows[0])
    if gt1 <= gt0 or clk1 <= clk0:  # the CTA did not finish recording: skip it
      continue
    rate = (clk1 - clk0) / (gt1 - gt0)  # cycles per ns
    start = gt0 - base
    ns = lambda clk, start=start, clk0=clk0, rate=rate: start + (int(clk) - clk0) / rate
    yield cta, rows, ns, rate, start, ns(clk1)


def tiles(trace: np.ndarray) -> list[dict]:
  """[{cta, j, tile, got, main_done, epilogue_done, start, end, ghz}] of every recorded tile: ns
  from the first CTA's start; ghz: its CTA's SM clock over the kernel (cycles per ns)."""
  out = []
  for cta, rows, ns, rate, start, end in _clocks(trace):
    for j, (t, got, main, epi) in enumerate(rows[1:1 + SLOTS]):
      if got == 0:
        break
      out.append({"cta": cta, "j": j, "tile": int(t), "start": start, "end": end, "ghz": rate,
                  "got": ns(got), "main_done": ns(main), "epilogue_done": ns(epi)})
  return out


def rounds(trace: np.ndarray) -> list[dict]:
  """[{cta, n, begin, waited, issued, arrived, added}] (ns; waited and issued None where the
  round had no wait and load of its own) of every recorded round of a GEMM+RS own tile's sum;
  begin: where the round's time starts, the CTA's latest main-loop end or round end before
  it."""
  out = []
  for cta, rows, ns, _, _, _ in _clocks(trace):
    marks = [ns(m) for _, got, m, _ in rows[1:1 + SLOTS] if got != 0]  # main loops' ends
    for n, stamps in enumerate(rows[1 + SLOTS:]):
      if stamps[2] == 0:  # not arrived: no round n
        break
      waited, issued, arrived, added = (ns(x) if x else None for x in stamps)
      first = waited if waited is not None else arrived
      begin = max([m for m in marks if m <= first], default=first)
      out.append({"cta": cta, "n": n, "begin": begin, "waited": waited, "issued": issued,
                  "arrived": arrived, "added": added})
      marks.append(added)
  return out


def summarize(trace: np.ndarray, kind=None) -> dict:
  """Medians and sums in µs; kind(tile) -> label splits the per-tile numbers (e.g. own/remote)."""
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
  groups = {}
  for r in recs:
    groups.setdefault(kind(r["tile"]) if kind else "all", []).append(r)
  for label, rs in sorted(groups.items()):
    out[f"main_us[{label}]"] = us(np.median([r["main_done"] - r["got"] for r in rs]))
    out[f"epilogue_us[{label}]"] = us(np.median([r["epilogue_done"] - r["main_done"] for r in rs]))
  gaps = [b["got"] - a["epilogue_done"] for rs in by_cta.values() for a, b in zip(rs, rs[1:])]
  out["gap_us_median"] = us(np.median(gaps)) if gaps else None
  out["gap_us_max"] = us(max(gaps)) if gaps else None
  leads = [rs[0]["got"] - t0 for rs in by_cta.values()]
  out["first_tile_at_us"] = [us(min(leads)), us(np.median(leads)), us(max(leads))]
  ends = [rs[-1]["epilogue_done"] - t0 for rs in by_cta.values()]
  out["last_epilogue_at_us"] = [us(min(ends)), us(np.median(ends)), us(max(ends))]
  own = rounds(trace)
  if own:
    loaded = [r for r in own if r["waited"] is not None]
    med = lambda xs: us(np.median(xs)) if xs else None
    out["round_us"] = {"rounds": len(own),
                       "wait": med([r["waited"] - r["begin"] for r in loaded]),
                       "issue": med([r["issued"] - r["waited"] for r in loaded]),
                       "arrive": med([r["arrived"] - (r["issued"] if r["issued"] is not None
                                                      else r["begin"]) for r in own]),
                       "add": med([r["added"] - r["arrived"] for r in own]),
                       "total": med([r["added"] - r["begin"] for r in own])}
  last = max(by_cta.values(), key=lambda rs: rs[-1]["epilogue_done"])
  out["last_cta"] = {
      "tiles": len(last),
      "first_tile_at_us": us(last[0]["got"] - t0),
      "main_us_sum": us(sum(r["main_done"] - r["got"] for r in last)),
      "epilogue_us_sum": us(sum(r["epilogue_done"] - r["main_done"] for r in last)),
      "gap_us_sum": us(sum(b["got"] - a["epilogue_done"] for a, b in zip(last, last[1:]))),
      "end_at_us": us(last[-1]["epilogue_done"] - t0)}
  return out
