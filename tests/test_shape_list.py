"""The benchmark's LLM shape list (jax_autooverlap/bench/data/llm_shapes.json) and its runner's
host side, on CPU: the list's arithmetic from the published model dimensions, the per-rank
GEMMs, the filters and the table."""
import json
import math

import pytest

from conftest import notebook_cell
from jax_autooverlap.bench import __main__ as bench
from jax_autooverlap.bench import shapes


def _expected_entries(doc):
  """The list rebuilt from its models and axes (bench/shapes.py's docstring says how)."""
  out, seen = [], {}
  for name, d in doc["models"].items():
    q = d["heads"] * d["head_dim"]
    projections = [("qkv", "ag", d["hidden"], q + 2 * d["kv_heads"] * d["head_dim"], False),
                   ("o", "rs", q, d["hidden"], False),
                   ("gate_up", "ag", d["hidden"], 2 * d["intermediate"], True),
                   ("down", "rs", d["intermediate"], d["hidden"], True)]
    for proj, op, k, n, mlp in projections:
      for w in doc["axes"]["tp"]:
        ms = [(t * d["experts_per_token"] // d["experts"] if mlp and "experts" in d else t, t)
              for t in doc["axes"]["tokens"]]
        for m, t in ms + [(m, None) for m in doc["axes"]["small_m"]]:
          key = (op, m, k, n, w)
          if key in seen:
            if name != seen[key]["model"]:
              seen[key]["also"].append(name)
            continue
          seen[key] = dict(model=name, projection=proj, op=op, m=m, k=k, n=n, world=w, tokens=t,
                           also=[])
          out.append(seen[key])
  return out


def test_list_is_its_models_projections_at_each_group_size_and_m():
  doc = json.loads(shapes.LIST.read_text())
  # the published dimensions (the models' config.json)
  dims = {name: (d["hidden"], d["intermediate"], d["heads"], d["kv_heads"], d["head_dim"])
          for name, d in doc["models"].items()}
  assert dims == {"llama3-8b": (4096, 14336, 32, 8, 128), "llama3-70b": (8192, 28672, 64, 8, 128),
                  "qwen2-72b": (8192, 29568, 64, 8, 128),
                  "mixtral-8x22b": (6144, 16384, 48, 8, 128)}
  assert (doc["models"]["mixtral-8x22b"]["experts"],
          doc["models"]["mixtral-8x22b"]["experts_per_token"]) == (8, 2)
  assert doc["axes"] == {"tp": [2, 4, 8], "tokens": [4096, 8192, 16384],
                         "small_m": [128, 256, 512, 1024]}
  got = [dict(e.__dict__, also=list(e.also)) for e in shapes.load()]
  assert got == _expected_entries(doc)
  # 4 models x 4 projections x 3 group sizes x 7 M, less Qwen2-72B's attention (Llama-3-70B's
  # shapes) and Mixtral's expert MLP at 4k tokens (its M = 1024 is a small M too)
  assert len(got) == 4 * 4 * 3 * 7 - 2 * 3 * 7 - 2 * 3
  assert sum(e["also"] == ["qwen2-72b"] for e in got) == 2 * 3 * 7


def test_each_entry_is_a_loopback_case_with_the_tp_ranks_gemm():
  """Per-rank GEMMs of the issue's examples (Llama-3 at 8k tokens, TP = 8), and every entry
  splits evenly over its group."""
  by = {(e.model, e.projection, e.world, e.m): e for e in shapes.load()}
  want = {("llama3-8b", "qkv"): (8192, 4096, 768), ("llama3-8b", "o"): (8192, 512, 4096),
          ("llama3-8b", "gate_up"): (8192, 4096, 3584), ("llama3-8b", "down"): (8192, 1792, 4096),
          ("llama3-70b", "qkv"): (8192, 8192, 1280), ("llama3-70b", "o"): (8192, 1024, 8192),
          ("llama3-70b", "gate_up"): (8192, 8192, 7168),
          ("llama3-70b", "down"): (8192, 3584, 8192)}
  for (model, proj), local in want.items():
    assert by[(model, proj, 8, 8192)].case().local_gemm == local
  # Mixtral's expert at 16k tokens: 16384 x 2 / 8 = 4096 rows
  e = by[("mixtral-8x22b", "down", 4, 4096)]
  assert e.tokens == 16384 and e.case().local_gemm == (4096, 4096, 6144)
  for e in shapes.load():
    c = e.case()  # raises where the group cannot split the shape
    rows = c.m // c.world
    assert rows * c.world == c.m and rows >= 16
    assert c.local_gemm == ((e.m, e.k, e.n // e.world) if e.op == "ag" else (e.m, e.k // e.world, e.n))


def test_qwen2_down_at_tp_4_and_8_runs_its_ragged_k():
  """29568 / 4 and / 8 (7392, 3696) are not multiples of the 64-column k-block: GEMM+RS runs
  them (its TMA loads fill the last k-block with zeros), an all-gather of that K is refused
  with the tuner's reason (it pushes whole 64-column blocks)."""
  from jax_autooverlap.bench.loopback import cli
  for w in ("w4", "w8"):
    (e,) = shapes.select(shapes.load(), ["qwen2-72b", "down", w, "m8192"])
    assert e.case().local_gemm[1] % 64 and shapes.unsupported_reason(e, "bfloat16") == (
        "no engine runs it")  # nothing to refuse: the tuner takes it
    assert list(cli.kernel_configs(e.case(), "NVIDIA H200", ["tl", "gluon"])) == ["tl", "gluon"]
  ag = shapes.Entry("x", "qkv", "ag", 8192, 3696, 1024, 8)
  assert shapes.unsupported_reason(ag, "bfloat16") == (
      "K=3696 must be a multiple of 64 (the all-gather pushes 64-column blocks)")


def test_filters_and_max_shapes():
  entries = shapes.load()
  sel = shapes.select(entries, ["w8", "m128|m8192", "llama3-8b"])
  assert {(e.world, e.m, e.model) for e in sel} == {(8, 128, "llama3-8b"), (8, 8192, "llama3-8b")}
  assert len(sel) == 8  # 4 projections x 2 M
  # a model named in `also` matches too
  assert {e.model for e in shapes.select(entries, ["qwen2-72b", "qkv"])} == {"llama3-70b"}
  assert {e.tokens is None for e in shapes.select(entries, ["small"])} == {True}
  spread = shapes.select(entries, ["rs"], 5)
  rs = shapes.select(entries, ["rs"])
  assert len(spread) == 5 and spread[0] == rs[0] and spread[-1] == rs[-1]
  assert len(set(spread)) == 5 and [rs.index(e) for e in spread] == sorted(rs.index(e) for e in spread)
  assert shapes.select(entries, ["nothing"]) == []


def test_list_command_prints_entries_without_a_gpu(capsys):
  assert bench.main(["shapes", "--loopback", "--list", "--filter", "w8", "--filter", "o",
                     "--filter", "m8192|m128"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[-1] == "6 entries"
  assert "llama3-8b o rs 8192x4096x4096 w8  local 8192x512x4096  (8192 tokens)" in out
  assert any("also qwen2-72b" in line for line in out)


def test_table_has_a_row_per_entry_with_ratios_target_and_reasons():
  base = dict(model="llama3-8b", projection="qkv", op="ag", m=8192, k=4096, n=6144, world_size=8,
              local_gemm=[8192, 4096, 768], gpu="NVIDIA-H200", dtype="bfloat16")
  small = dict(base, m=128, local_gemm=[128, 4096, 768])
  records = [dict(base, impl="gemm_alone", median_ms=0.1),
             dict(base, impl="ours_tl", median_ms=0.13, engine="tl"),
             dict(base, impl="engine_alone", median_ms=0.104, engine="gluon"),
             dict(base, impl="ours", median_ms=0.108, engine="gluon",
                  kernel={"engine": "gluon", "block_m": 128, "block_n": 128, "wg_partitions": False,
                          "num_comm": 64}),
             dict(small, impl="gemm_alone", median_ms=0.01),
             dict(small, impl="ours", median_ms=0.0124, engine="tl",
                  kernel={"engine": "tl", "block_m": 64, "block_n": 128, "split_k": 4}),
             dict(base, projection="down", op="rs", m=8192, k=29568, n=8192, model="qwen2-72b",
                  impl="unsupported", reason="K=3696 must be a multiple of 64")]
  rows = shapes.table_rows(records)
  # the floor: 7 peers' shards of 1024 x 4096 bf16 at the H200 model's copy-engine rate, over
  # the 0.1 ms GEMM
  from jax_autooverlap.tuning import model
  link_gbps = model.load("NVIDIA H200", 8, "bfloat16").group.link_gbps
  assert 300 < link_gbps < 478  # between NCCL's and NVLink's peak (shared/DESIGN.md)
  floor = 7 * 1024 * 4096 * 2 / (link_gbps * 1e9) / 0.1e-3
  assert rows[0] == ("llama3-8b", "qkv", "ag", 8, "8192x4096x6144", "8192x4096x768", "0.1000",
                     "1.080", "gluon-128x128-m64", "1.040", "1.300", "-", f"{floor:.2f}", "1.10",
                     "yes", "-")
  # below 20 us of GEMM the target is 1.25; no engine-alone or tl record: "-" (not measured);
  # 16-row shards move in less time than the GEMM: the floor is the GEMM
  assert rows[1][4:] == ("128x4096x6144", "128x4096x768", "0.0100", "1.240", "tl-64x128-k4", "-",
                         "-", "-", "1.00", "1.25", "yes", "-")
  assert rows[2] == ("qwen2-72b", "down", "rs", 8, "8192x29568x8192", "-", "-", "-",
                     "K=3696 must be a multiple of 64", "-", "-", "-", "-", "-", "-", "-")
  # RS: the peers' partials of this GPU's rows (bf16 for fp8 operands too); a kind without a
  # cost model has no floor
  rs = dict(base, op="rs", k=1024 * 8, n=8192, dtype="float8_e4m3fn")
  assert shapes.link_floor_ms(rs, 0.01) == pytest.approx(7 * 1024 * 8192 * 2 / (link_gbps * 1e6))
  assert math.isnan(shapes.link_floor_ms(dict(rs, gpu="Some-Other-GPU"), 0.01))
  table = shapes.format_table(records)
  assert table.splitlines()[-1] == "target met on 2 of 2 measured entries"
  assert "ours/cuBLAS" in table.splitlines()[1]
  assert table.startswith("Shape list in loopback, bfloat16 operands")
  records[3]["median_ms"] = 0.111
  assert shapes.table_rows(records)[0][-2:] == ("no", "link")  # the floor is 1.53 x
  # the engine with its best tiles decides between engine and fused; its column shows the
  # fastest Gluon variant's tiles
  small_rows = [dict(small, impl="gemm_alone", median_ms=0.01),
                dict(small, impl="ours", median_ms=0.02, kernel={"engine": "gluon"}),
                dict(small, impl="engine_alone", median_ms=0.013,
                     tiles_ms={"64x256": 0.013, "64x128": 0.012})]
  assert shapes.table_rows(small_rows)[0][9] == "1.300"
  assert shapes.table_rows(small_rows)[0][-1] == "fused"  # 64x128 alone: 1.2 x
  small_rows[2]["tiles_ms"]["64x128"] = 0.0126
  assert shapes.table_rows(small_rows)[0][-1] == "engine"
  # ours on tl: the Gluon engine alone says nothing of it (here the tl kernel is the faster);
  # its own kernel alone, in a group of one, decides
  small_rows[1] = dict(small, impl="ours", median_ms=0.0128, engine="tl",
                       kernel={"engine": "tl", "block_m": 128, "block_n": 128, "split_k": 8,
                               "pack_shards": True})
  assert shapes.table_rows(small_rows)[0][-1] == "?"
  small_rows.append(dict(small, impl="engine_alone_tl", median_ms=0.0121, engine="tl"))
  assert shapes.table_rows(small_rows)[0][9:12] == ("1.300", "-", "1.210")
  assert shapes.table_rows(small_rows)[0][-1] == "fused"  # alone within 1.25: the fused part
  small_rows[-1]["median_ms"] = 0.0127
  assert shapes.table_rows(small_rows)[0][-1] == "engine"
  assert shapes.format_table(records).splitlines()[-1] == (
      "target met on 1 of 2 measured entries; bound by link: 1")
  assert shapes.target(0.020) == 1.10 and shapes.target(0.0199) == 1.25


def test_a_missed_target_is_put_on_the_link_the_engine_or_the_fused_kernel():
  """From the measured ratios to cuBLAS: the node's overlap floor above the target, else the
  Gluon engine alone above it, else what the fused kernel adds."""
  assert shapes.bound_by(1.05, 1.02, 1.0, 1.10) == "-"
  assert shapes.bound_by(1.30, 1.02, 1.47, 1.10) == "link"
  assert shapes.bound_by(1.37, 1.33, 1.00, 1.10) == "engine"
  assert shapes.bound_by(1.24, 1.05, 1.03, 1.10) == "fused"
  assert shapes.bound_by(1.24, float("nan"), 1.03, 1.10) == "?"
  assert shapes.bound_by(float("nan"), 1.0, 1.0, 1.10) == "-"


def test_parse_args():
  args = shapes.parser().parse_args(["--loopback", "--filter", "w8", "--filter", "ag",
                                     "--max-shapes", "12"])
  assert (args.filter, args.max_shapes, args.rounds, args.calls) == (["w8", "ag"], 12, 5, 20)
  args = shapes.parser().parse_args(["--loopback", "--movers", "tl=16,48", "--movers", "gluon=132"])
  from jax_autooverlap.bench.loopback import cli
  assert cli.parse_movers(args.movers) == {"tl": (16, 48), "gluon": (132,)}
  args = shapes.parser().parse_args(["--loopback", "--variant", "tl:split_k=2,pack_shards=1"])
  assert cli.parse_variants(args.variant) == (("tl", {"split_k": 2, "pack_shards": True}),)
  for bad in ("tl", "tl=", "cuda=4", "tl=4,x", "gluon=0"):
    with pytest.raises(ValueError, match="--movers"):
      cli.parse_movers([bad])
  with pytest.raises(SystemExit):
    shapes.parser().parse_args([])


def test_records_of_several_runs_merge_in_list_order_the_later_run_winning(tmp_path, capsys):
  """A list measured over several device calls: --table-from builds one table from their
  files, --skip-measured leaves out what they hold."""
  def rec(m, impl, ms, **kw):
    return dict(model="llama3-8b", projection="qkv", op="ag", m=m, k=4096, n=6144, world_size=8,
                local_gemm=[m, 4096, 768], gpu="NVIDIA-H200", dtype="bfloat16", impl=impl,
                median_ms=ms, **kw)
  ours = dict(engine="gluon", kernel={"engine": "gluon", "block_m": 128, "block_n": 256,
                                      "wg_partitions": False, "num_comm": 64})
  run1 = [rec(8192, "gemm_alone", 0.1), rec(8192, "ours", 0.2, **ours),
          rec(4096, "gemm_alone", 0.05), rec(4096, "ours", 0.052, **ours)]
  alone1 = [rec(8192, "engine_alone", 0.11, engine="gluon")]
  run2 = [rec(8192, "gemm_alone", 0.1), rec(8192, "ours", 0.105, **ours)]  # re-measured
  paths = []
  for i, recs in enumerate((run1, alone1, run2)):
    paths.append(tmp_path / f"{i}.json")
    paths[-1].write_text(json.dumps(recs))
  merged = shapes.read_records(paths)
  # list order (4096 tokens before 8192), run 2's timing, run 1's engine alone kept
  assert [(r["m"], r["impl"], r["median_ms"]) for r in merged] == [
      (4096, "gemm_alone", 0.05), (4096, "ours", 0.052),
      (8192, "gemm_alone", 0.1), (8192, "ours", 0.105), (8192, "engine_alone", 0.11)]
  assert bench.main(["shapes", "--loopback", "--table-from", *map(str, paths)]) == 0
  rows = capsys.readouterr().out.splitlines()
  assert rows[-1] == "target met on 2 of 2 measured entries"
  assert rows[-2].split()[7:10] == ["1.050", "gluon-m64", "1.100"]  # ours, kernel, engine alone
  # --skip-measured: of Llama-3-8B's Q/K/V at TP 8 and 4k/8k tokens, nothing is left to run
  assert bench.main(["shapes", "--loopback", "--list", "--filter", "llama3-8b", "--filter", "qkv",
                     "--filter", "w8", "--filter", "step", "--skip-measured", str(paths[0])]) == 0
  out, err = capsys.readouterr()
  assert out.splitlines() == ["llama3-8b qkv ag 16384x4096x6144 w8  local 16384x4096x768  "
                              "(16384 tokens)", "1 entries"]
  assert "2 of 3 selected entries already measured" in err


def test_runs_of_several_dtypes_make_no_table_and_skip_only_their_own_entries(tmp_path, capsys):
  """An entry is the same shape in every dtype: --table-from refuses bf16 and fp8 runs together
  (one would replace the other's rows), naming both; --skip-measured skips only the entries its
  files measured in --dtype; a .txt names the runs (listed_runs, relative to itself, in order)."""
  def rec(dtype, impl, ms):
    return dict(model="llama3-8b", projection="qkv", op="ag", m=4096, k=4096, n=6144,
                world_size=8, local_gemm=[4096, 4096, 768], gpu="NVIDIA-H200", dtype=dtype,
                impl=impl, median_ms=ms)
  bf16, fp8 = tmp_path / "runs" / "bf16.json", tmp_path / "runs" / "fp8.json"
  bf16.parent.mkdir()
  bf16.write_text(json.dumps([rec("bfloat16", "gemm_alone", 0.05), rec("bfloat16", "ours", 0.06)]))
  fp8.write_text(json.dumps([rec("float8_e4m3fn", "gemm_alone", 0.03),
                             rec("float8_e4m3fn", "ours", 0.031)]))
  with pytest.raises(ValueError, match=r"several operand dtypes.*bfloat16 in 1 file "
                                       r"\(.*bf16\.json\); float8_e4m3fn in 1 file \(.*fp8\.json\)"):
    shapes.read_records([bf16, fp8])
  assert bench.main(["shapes", "--loopback", "--table-from", str(bf16), str(fp8)]) == 2
  assert "several operand dtypes" in capsys.readouterr().err
  fp8_only = shapes.read_records([bf16, fp8], "float8_e4m3fn")
  assert [r["median_ms"] for r in fp8_only] == [0.03, 0.031]
  # the manifest: comments and blank lines skipped, paths relative to it, its order kept
  manifest = tmp_path / "runs.txt"
  manifest.write_text("# the runs\n\nruns/fp8.json  # first\nruns/bf16.json\n")
  assert shapes.listed_runs(manifest) == [fp8, bf16]
  manifest.write_text("runs/bf16.json\n")
  assert bench.main(["shapes", "--loopback", "--table-from", str(manifest)]) == 0
  assert "1.200" in capsys.readouterr().out.splitlines()[2].split()
  for dtype, left in (("bfloat16", 0), ("float8_e4m3fn", 1)):
    assert bench.main(["shapes", "--loopback", "--list", "--dtype", dtype, "--filter", "llama3-8b",
                       "--filter", "qkv", "--filter", "w8", "--filter", "m4096",
                       "--skip-measured", str(bf16)]) == 0  # a bf16 run's entries
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{left} entries"


def test_entries_with_an_unknown_bound_are_selected_from_the_runs(tmp_path, capsys):
  """--bound-unknown-in: of the selected entries, only those whose row in the given runs'
  table misses its target with bound "?" (a tl kernel without its alone record): the next
  runs to re-measure."""
  def rec(m, impl, ms, **kw):
    return dict(model="llama3-8b", projection="qkv", op="ag", m=m, k=4096, n=6144, world_size=8,
                local_gemm=[m, 4096, 768], gpu="NVIDIA-H200", dtype="bfloat16", impl=impl,
                median_ms=ms, **kw)
  records = [rec(128, "gemm_alone", 0.0075), rec(128, "ours", 0.012, engine="tl"),
             rec(256, "gemm_alone", 0.0097), rec(256, "ours", 0.0144, engine="tl"),
             rec(256, "engine_alone_tl", 0.013, engine="tl"),  # over 1.25 alone: "engine"
             rec(512, "gemm_alone", 0.01), rec(512, "ours", 0.0105, engine="tl")]  # met
  run = tmp_path / "run.json"
  run.write_text(json.dumps(records))
  (tmp_path / "runs.txt").write_text("run.json\n")
  rows = {r[4]: r[-1] for r in shapes.table_rows(shapes.read_records([run]))}
  assert rows == {"128x4096x6144": "?", "256x4096x6144": "engine", "512x4096x6144": "-"}
  for runs in (str(run), str(tmp_path / "runs.txt")):
    assert bench.main(["shapes", "--loopback", "--list", "--filter", "llama3-8b", "--filter",
                       "qkv", "--filter", "w8", "--bound-unknown-in", runs]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == ["llama3-8b qkv ag 128x4096x6144 w8  local 128x4096x768",
                                "1 entries"]
    assert "1 of 7 selected entries miss their target with an unknown bound" in err


def test_configs_from_times_again_only_the_recorded_configs_of_ours_and_ours_tl(tmp_path,
                                                                               monkeypatch):
  """--configs-from: each selected entry that the runs hold runs bench_case with only the
  configs its latest run recorded for ours and ours_tl (one variant where they are one config),
  its records say so; entries the runs do not hold are skipped."""
  import dataclasses
  import types
  from jax_autooverlap.bench.loopback import cli
  from jax_autooverlap.tuning.config import KernelConfig
  tl = KernelConfig(block_m=128, block_n=128, num_comm=32, split_k=8, pack_shards=True)
  gluon = KernelConfig(block_m=64, block_n=256, num_warps=4, chunks=2, engine="gluon")
  def rec(m, impl, ms, kernel=None):
    r = dict(model="llama3-8b", projection="qkv", op="ag", m=m, k=4096, n=6144, world_size=8,
             local_gemm=[m, 4096, 768], gpu="NVIDIA-H200", dtype="bfloat16", impl=impl,
             median_ms=ms)
    return {**r, "engine": kernel.engine, "kernel": dataclasses.asdict(kernel)} if kernel else r
  old = [rec(128, "gemm_alone", 0.0075), rec(128, "ours_tl", 0.012, tl),
         rec(128, "ours", 0.012, tl),
         rec(256, "gemm_alone", 0.0097), rec(256, "ours_tl", 0.0144, tl),
         rec(256, "ours", 0.0131, gluon)]
  older = tmp_path / "older.json"  # an earlier run of 128 with another config: overridden
  older.write_text(json.dumps([rec(128, "gemm_alone", 0.0075),
                               rec(128, "ours", 0.02, dataclasses.replace(tl, split_k=2))]))
  run = tmp_path / "run.json"
  run.write_text(json.dumps(old))
  recorded = shapes.recorded_configs(shapes.read_records([older, run]))
  assert recorded == {
      ("llama3-8b", "qkv", "ag", 128, 4096, 6144, 8): {"tl-128x128-k8-p": tl},
      ("llama3-8b", "qkv", "ag", 256, 4096, 6144, 8): {"tl-128x128-k8-p": tl,
                                                        "gluon-64x256": gluon}}
  calls = []
  def bench_case(case, device, engines, rounds, calls_, movers, first_call, extra, variants,
                 stages):
    calls.append((case.m, variants, stages))
    return [{"impl": "gemm_alone", "median_ms": 0.01}]
  device = types.SimpleNamespace(device_kind="NVIDIA H200")
  monkeypatch.setattr(cli, "gpus_and_engines", lambda arg, what: ([device], ["tl", "gluon"]))
  monkeypatch.setattr(cli, "bench_case", bench_case)
  monkeypatch.setattr(shapes.common, "gpu_name", lambda d: "NVIDIA-H200")
  assert bench.main(["shapes", "--loopback", "--filter", "llama3-8b", "--filter", "qkv",
                     "--filter", "w8", "--configs-from", str(older), str(run),
                     "--out", str(tmp_path / "out")]) == 0
  assert calls == [(128, recorded[("llama3-8b", "qkv", "ag", 128, 4096, 6144, 8)], ()),
                   (256, recorded[("llama3-8b", "qkv", "ag", 256, 4096, 6144, 8)], ())]
  written = json.loads(next((tmp_path / "out").glob("*-shapes-loopback.json")).read_text())
  assert [(r["m"], r["configs_from"]) for r in written] == [(128, [str(older), str(run)]),
                                                            (256, [str(older), str(run)])]
  # Gluon only: 128's one config is tl, so it is skipped, not run with cuBLAS alone
  calls.clear()
  monkeypatch.setattr(cli, "gpus_and_engines", lambda arg, what: ([device], ["gluon"]))
  assert bench.main(["shapes", "--loopback", "--filter", "llama3-8b", "--filter", "qkv",
                     "--filter", "w8", "--configs-from", str(run), "--engines", "gluon",
                     "--out", str(tmp_path / "out2")]) == 0
  assert calls == [(256, {"gluon-64x256": gluon}, ())]
  # --stages: the recorded configs in those pipeline depths too (bench_case adds them)
  calls.clear()
  assert bench.main(["shapes", "--loopback", "--filter", "llama3-8b", "--filter", "qkv",
                     "--filter", "w8", "--configs-from", str(run), "--stages", "4,6",
                     "--out", str(tmp_path / "out3")]) == 0
  assert calls == [(256, {"gluon-64x256": gluon}, (4, 6))]


@pytest.mark.parametrize("manifest,table,dtype", [
    ("shapes-runs.txt", "shapes-table-all-measured.txt", "bfloat16"),
    ("shapes-runs-fp8.txt", "shapes-table-fp8-all-measured.txt", "float8_e4m3fn")])
def test_the_committed_tables_are_what_their_runs_give(manifest, table, dtype):
  """bench/results/shapes-runs*.txt name the runs of the newest committed all-measured tables
  (bf16, fp8): each file exists and holds that dtype's records, and the table built from them
  is that file."""
  import pathlib
  results = pathlib.Path(__file__).parents[1] / "bench" / "results"
  runs = shapes.listed_runs(results / manifest)
  assert runs and all(p.exists() for p in runs)
  newest = sorted(results.glob(f"round-*/{table}"))[-1].read_text().rstrip("\n")
  assert shapes.format_table(shapes.read_records(runs, dtype)) == newest
  assert shapes.format_table(shapes.read_records(runs)) == newest


def test_a_run_cut_short_keeps_every_measured_entry_engine_alone_too(tmp_path):
  """The list's run writes its records after every entry, the engine alone's with them (a
  device call cut by its time limit kept the fused kernels' times but not the engine's)."""
  def rec(impl, ms):
    return dict(model="llama3-8b", projection="qkv", op="ag", m=128, k=4096, n=6144,
                world_size=8, local_gemm=[128, 4096, 768], gpu="NVIDIA-H200", dtype="bfloat16",
                impl=impl, median_ms=ms)
  stem = tmp_path / "NVIDIA-H200-x1-2026-12-03-shapes"
  records = [rec("gemm_alone", 0.0075), rec("ours", 0.0124), rec("engine_alone", 0.017)]
  path = shapes.write_records(stem, "", records)
  assert path == tmp_path / "NVIDIA-H200-x1-2026-12-03-shapes-loopback.json"
  assert [r["impl"] for r in json.loads(path.read_text())] == ["gemm_alone", "ours"]
  engine = json.loads((tmp_path / "NVIDIA-H200-x1-2026-12-03-shapes-engine-alone.json")
                      .read_text())
  assert [(r["impl"], r["mode"], r["median_ms"]) for r in engine] == [
      ("engine_alone", "engine", 0.017)]
  rows = shapes.table_rows(shapes.read_records(sorted(tmp_path.glob("*.json"))))
  assert rows[0][7:10] == ("1.653", "tl", "2.267")  # ours, kernel, engine alone / cuBLAS


def test_notebook_shape_list_cell_plots_each_entry_by_what_bounds_it(tmp_path, monkeypatch,
                                                                     capsys):
  """The notebook's shape-list cell says when there are no runs, else reads the runs that
  bench/results/shapes-runs.txt names (a later run's entry replacing an earlier one's), prints
  the counts by what bounds the entries and draws one bar per measured entry, coloured by it."""
  import sys
  import unittest.mock
  cell = notebook_cell("shapes.read_records")
  monkeypatch.chdir(tmp_path)
  exec(cell, {})
  assert "no shape-list results yet" in capsys.readouterr().out
  base = dict(model="llama3-8b", projection="qkv", op="ag", m=8192, k=4096, n=6144, world_size=8,
              local_gemm=[8192, 4096, 768], gpu="NVIDIA-H200", dtype="bfloat16")
  small = dict(base, m=128, local_gemm=[128, 4096, 768])
  first = [dict(base, impl="gemm_alone", median_ms=0.1), dict(base, impl="ours", median_ms=0.2),
           dict(small, impl="gemm_alone", median_ms=0.01), dict(small, impl="ours", median_ms=0.02)]
  later = [dict(small, impl="gemm_alone", median_ms=0.01), dict(small, impl="ours", median_ms=0.012)]
  for name, records in (("round-a/x", first), ("round-b/y", later)):
    run = tmp_path / "bench" / "results" / name
    run.mkdir(parents=True)
    (run / "GPU-shapes-loopback.json").write_text(json.dumps(records))
  (tmp_path / "bench" / "results" / "shapes-runs.txt").write_text(
      "round-a/x/GPU-shapes-loopback.json\nround-b/y/GPU-shapes-loopback.json\n")
  plt, ax = unittest.mock.MagicMock(), unittest.mock.MagicMock()
  plt.subplots.return_value = (unittest.mock.MagicMock(), ax)
  monkeypatch.setitem(sys.modules, "matplotlib", unittest.mock.MagicMock(pyplot=plt))
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
  exec(cell, {})
  # 8192 rows: 2.0 x, the node's floor 1.53 x over the 1.10 target; 128 rows: the later run's
  # 1.2 x, within 1.25
  assert "2 entries: bound by link 1, met 1" in capsys.readouterr().out
  (ys, ratios), kw = ax.barh.call_args
  assert list(ratios) == [2.0, 1.2] and kw["color"] == ["tab:gray", "tab:green"]
  assert plt.show.called


def test_first_call_coverage_compares_the_first_calls_best_with_the_best_timed(tmp_path):
  """bench shapes --first-call-coverage: per op, the best of the configs a first call times
  (matched to the runs' variants by engine, tiles, split and packing) over the best variant
  timed, per entry at M <= 1024 from its latest record that timed every variant."""
  def rec(model, proj, op, m, k, n, w, variants, **extra):
    return {"model": model, "projection": proj, "op": op, "m": m, "k": k, "n": n,
            "world_size": w, "dtype": "bfloat16", "impl": "ours", "median_ms": min(
                variants.values()), "variants_ms": variants, **extra}
  # Llama-3-8B o, TP 4, M = 128: its first call times tl, gluon, tl-128x128-k4-p,
  # tl-128x64-p, tl-64x256-k2, gluon-64x256 (the chunks aside)
  o = rec("llama3-8b", "o", "rs", 128, 4096, 4096, 4,
          {"tl-64x128": 0.010, "gluon-64x256": 0.012, "tl": 0.02, "tl-64x256-k2-m8": 0.03})
  # a later run that re-timed only the recorded configs: not a full record, ignored
  redo = rec("llama3-8b", "o", "rs", 128, 4096, 4096, 4, {"tl-64x128": 0.001},
             configs_from=["x"])
  # AG: the tail split's tile count and the suffixes of a mover sweep and of --stages do not
  # tell configs apart
  qkv = rec("llama3-70b", "qkv", "ag", 1024, 8192, 10240, 2,
            {"tl-k2-t44-m16-s4": 0.0146, "tl-m48": 0.02, "gluon-64x128": 0.03})
  big = rec("llama3-8b", "o", "rs", 8192, 4096, 4096, 4, {"tl": 0.5, "tl-64x128": 0.1})
  path = tmp_path / "runs.json"
  path.write_text(json.dumps([o, redo, qkv, big]))
  got = shapes.first_call_coverage([path])
  n, mean, over, worst = got["rs"]  # gluon-64x256's 12 us against tl-64x128's 10
  assert (n, over, worst) == (1, 1, (0.012 / 0.010, "llama3-8b o rs 128x4096x4096 w4"))
  assert mean == pytest.approx(1.2)
  n, mean, over, worst = got["ag"]  # the tail split timed is the first call's
  assert (n, mean, over, worst) == (1, 1.0, 0, (1.0, "llama3-70b qkv ag 1024x8192x10240 w2"))
  assert bench.main(["shapes", "--loopback", "--first-call-coverage", str(path)]) == 0


def test_notebook_first_call_cell_prints_each_ops_coverage(tmp_path, monkeypatch, capsys):
  """The notebook's first-call cell says when there are no runs, else prints per op how close a
  first call's best config comes to the best variant timed (shapes.first_call_coverage)."""
  cell = notebook_cell("shapes.first_call_coverage")
  monkeypatch.chdir(tmp_path)
  exec(cell, {})
  assert "no shape-list results yet" in capsys.readouterr().out
  run = tmp_path / "bench" / "results" / "r"
  run.mkdir(parents=True)
  # Llama-3-8B o, TP 4, M = 128: gluon-64x256 (a first call's) 12 us, tl-64x128 (not) 10 us
  (run / "x.json").write_text(json.dumps([{
      "model": "llama3-8b", "projection": "o", "op": "rs", "m": 128, "k": 4096, "n": 4096,
      "world_size": 4, "dtype": "bfloat16", "impl": "ours", "median_ms": 0.010,
      "variants_ms": {"tl-64x128": 0.010, "gluon-64x256": 0.012}}]))
  (tmp_path / "bench" / "results" / "shapes-runs.txt").write_text("r/x.json\n")
  exec(cell, {})
  assert capsys.readouterr().out == ("rs: 1 entries: first call best / best timed 1.2000 "
                                     "(geometric mean), 1 over 1.05, worst 1.200 (llama3-8b o "
                                     "rs 128x4096x4096 w4)\n")
