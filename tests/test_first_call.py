"""First-call measurement (no GPU needed): the decision on injected timings (margin, failing
candidates, ties, the unfused program failing), the protocol's steps, the candidate lists, cache
keys and their invalidation when the kernel sources change, explain's rows for shapes still to
be measured, and the whole path from an ao.jit call on CPU devices planned as GPUs.  Agreement
across real jax.distributed processes: tests/test_multiprocess.py."""

import collections
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_autooverlap as ao
from conftest import cpu_mesh, stand_in_kernels
from jax_autooverlap import backends
from jax_autooverlap.ops import measure
from jax_autooverlap.ops.planning import plan
from jax_autooverlap.tuning import autotune, select, store
from jax_autooverlap.tuning import model as cost_model
from jax_autooverlap.tuning.config import KernelConfig, OverlapConfig

BF16 = jnp.bfloat16
H200 = "NVIDIA H200"
decide = autotune.decide


# --- the decision, on injected timings ----------------------------------------------------

def rounds(ms, noise=(0,) * 7):
  """Per-round times: ms x (1 + noise of each round)."""
  return [ms * (1 + e) for e in noise]


def test_fused_runs_only_when_faster_by_the_noise_margin():
  quiet = (0.001, -0.001, 0.0, 0.002, -0.002, 0.0, 0.001)
  noisy = (0.06, -0.05, 0.0, 0.04, -0.07, 0.05, -0.04)
  unfused = rounds(1.0)
  out = decide(unfused, [rounds(0.80, quiet)])
  assert out.choice == 0 and out.margin == autotune.MIN_MARGIN and "20.0 % faster" in out.note
  out = decide(unfused, [rounds(0.97, quiet)])  # 3 %, quiet rounds: clears the 1 % floor
  assert out.choice == 0
  out = decide(unfused, [rounds(0.97, noisy)])  # 3 % within the rounds' spread: unfused
  assert out.choice is None and out.margin > 0.03 and "within the margin" in out.note
  out = decide(unfused, [rounds(0.995, quiet)])  # below the floor
  assert out.choice is None and out.margin == autotune.MIN_MARGIN
  out = decide(unfused, [rounds(1.1, quiet)])
  assert out.choice is None and "10.0 % slower" in out.note
  assert out.ours_ms == pytest.approx(1.1) and out.unfused_ms == pytest.approx(1.0)


def test_margin_is_z_standard_errors_of_the_median_ratio():
  ratios = [0.90, 0.92, 0.94, 0.96, 0.98, 1.00, 1.02]
  sigma = 1.4826 * 0.04  # median absolute deviation about the median 0.96
  assert autotune.margin_of(ratios) == pytest.approx(
      autotune.Z * 1.2533 * sigma / np.sqrt(7))
  assert autotune.margin_of([0.9] * 7) == autotune.MIN_MARGIN


def test_rounds_are_paired_so_drift_common_to_both_programs_cancels():
  drift = (0.08, -0.08, 0.06, -0.06, 0.0, 0.07, -0.07)  # clocks moving round to round (H200)
  out = decide(rounds(1.0, drift), [rounds(0.95, drift)])
  assert out.choice == 0 and out.margin == autotune.MIN_MARGIN  # every round: exactly 0.95


def test_failing_candidates_are_dropped_never_chosen():
  unfused = rounds(1.0)
  out = decide(unfused, ["run: CollectiveTimeoutError: peer 1 never arrived", rounds(0.9),
                         "result off the reference: relative error 3.1e-01 > 0.02"])
  assert out.choice == 1 and set(out.failed) == {"0", "2"}
  out = decide(unfused, ["compile: error", "compile: error"])
  assert out.choice is None and out.persist and "every kernel candidate failed" in out.note


def test_ties_go_to_the_earlier_candidate_and_to_the_unfused_program():
  unfused = rounds(1.0)
  assert decide(unfused, [rounds(0.9), rounds(0.9)]).choice == 0
  assert decide(unfused, [rounds(1.2), rounds(0.9), rounds(0.9)]).choice == 1
  assert decide(unfused, [rounds(1.0)]).choice is None


def test_unfused_program_failing_leaves_the_fastest_candidate_that_passed():
  nccl = "run: XlaRuntimeError: NCCL ... Duplicate GPU detected"
  out = decide(nccl, [rounds(1.2), "result off the reference", rounds(0.9), rounds(0.9)])
  assert out.choice == 2 and out.unfused_ms is None and out.persist
  assert "the unfused program failed here" in out.note and "Duplicate GPU" in out.note
  out = decide(nccl, ["compile: error"])  # nothing ran: nothing worth keeping
  assert out.choice is None and not out.persist


# --- the protocol's steps (fake programs, one process) --------------------------------------

class FakeProgram:
  """An autotune.Program with injected behaviour: `fail` at "compile", "check" or "time"."""

  def __init__(self, label, ms, fail=None, log=None):
    self.label, self.ms, self.fail, self.log = label, ms, fail, log if log is not None else []

  def compile(self):
    if self.fail == "compile":
      raise RuntimeError("Triton: out of resources")

  def check(self):
    if self.fail == "check":
      raise ValueError("result off the reference: relative error 2.0e-01 > 0.02")

  def time(self, iters):
    self.log.append((self.label, iters))
    if self.fail == "time":
      raise RuntimeError("CollectiveTimeoutError")
    return self.ms


class OneProcess:
  first = True

  def __init__(self, others=()):
    self.others, self.steps = others, []  # others: {process: payload per step}

  def exchange(self, step, payload):
    self.steps.append(step)
    return {0: payload, **{p: got[step] for p, got in self.others}}

  def conclude(self, ok, reason):
    return ok, reason


def test_protocol_drops_failures_and_interleaves_rounds():
  log = []
  programs = [FakeProgram("unfused", 1.0, log=log), FakeProgram("0", 0.5, "compile", log),
              FakeProgram("1", 0.8, log=log), FakeProgram("2", 0.7, "check", log),
              FakeProgram("3", 2.0, log=log)]
  agreement = OneProcess()
  got = autotune.measure(programs, agreement, rounds=3)
  assert agreement.steps == ["compiled", "checked", "timed"]
  assert got["0"].startswith("compile: RuntimeError") and got["2"].startswith("ValueError")
  assert got["unfused"] == [1.0] * 3 and got["1"] == [0.8] * 3 and got["3"] == [2.0] * 3
  timed = [label for label, iters in log if iters > 1]  # the rounds, after one call each
  assert timed == ["unfused", "1", "3", "1", "3", "unfused", "3", "unfused", "1"]
  iters = dict((label, n) for label, n in log if n > 1)
  assert iters == {"unfused": 20, "1": 25, "3": 10}  # about ROUND_MS per program and round


def test_programs_compile_concurrently_and_failures_stay_theirs(monkeypatch):
  """compile_all: the programs compile in threads at once (three compiles meet at a barrier
  that one thread alone would never pass), each failure named by its program."""
  import threading
  monkeypatch.setattr(autotune.os, "cpu_count", lambda: 8)
  met = threading.Barrier(3, timeout=10)

  class Meeting(FakeProgram):
    def compile(self):
      met.wait()
      super().compile()
  programs = [Meeting("unfused", 1.0), Meeting("0", 1.0, "compile"), Meeting("1", 1.0)]
  assert autotune.compile_all(programs) == {"0": "compile: RuntimeError: Triton: out of resources"}
  monkeypatch.setattr(autotune.os, "cpu_count", lambda: 1)  # one thread: in order
  order = []

  class Ordered(FakeProgram):
    def compile(self):
      order.append(self.label)
  assert autotune.compile_all([Ordered(l, 1.0) for l in "abc"]) == {} and order == list("abc")


def test_protocol_takes_the_slowest_process_of_each_round():
  other = {"compiled": {l: {"error": None} for l in ("unfused", "0")},
           "checked": {"unfused": {"error": None, "ms": 1.0}, "0": {"error": None, "ms": 4.0}},
           "timed": {"unfused": {"error": None, "rounds": [0.9, 1.5, 0.9]},
                     "0": {"error": None, "rounds": [0.7, 0.7, 0.7]}}}
  log = []
  got = autotune.measure([FakeProgram("unfused", 1.0, log=log), FakeProgram("0", 0.8, log=log)],
                         OneProcess(others=[(1, other)]), rounds=3)
  assert got == {"unfused": [1.0, 1.5, 1.0], "0": [0.8, 0.8, 0.8]}
  assert dict((l, n) for l, n in log if n > 1)["0"] == 5  # from the slower process's 4 ms


def test_a_program_failing_in_another_process_is_dropped_in_this_one():
  other = {"compiled": {"unfused": {"error": None}, "0": {"error": "RuntimeError: no memory"},
                        "1": {"error": None}},
           "checked": {"unfused": {"error": None, "ms": 1.0}, "1": {"error": None, "ms": 1.0},
                       "0": {"error": "RuntimeError: no memory"}},
           "timed": {l: {"error": None, "rounds": [1.0] * 2} for l in ("unfused", "1")}}
  other["timed"]["0"] = {"error": "RuntimeError: no memory", "rounds": None}
  log = []
  got = autotune.measure([FakeProgram(l, 1.0, log=log) for l in ("unfused", "0", "1")],
                         OneProcess(others=[(1, other)]), rounds=2)
  assert got["0"] == "process 1: RuntimeError: no memory"
  assert "0" not in {label for label, _ in log}  # never run here either


# --- candidates -----------------------------------------------------------------------------

def test_fixed_candidates_per_group_size_and_engine():
  for w in (2, 4, 8):
    ag = select.default_candidates("ag", w, BF16, "9.0")
    rs = select.default_candidates("rs", w, BF16, "9.0")
    assert [c.engine for c in ag] == ["tl", "tl", "gluon", "gluon"]
    assert [(c.engine, c.wg_partitions) for c in rs] == [
        ("tl", False), ("tl", False), ("gluon", False), ("gluon", True)]
    assert len(set(ag)) == 4 and len(set(rs)) == 4
    assert select.default_candidates("ag", w, BF16, "8.0") == ag[:2]  # no Gluon off sm_90
    (f32,) = select.default_candidates("ag", w, np.float32, "9.0")  # one tl config
    assert f32.engine == "tl" and select.unsupported(1024, 4096, 4096, np.float32,
                                                     np.float32, f32) is None
  # w - 1 copies of the shard to push: groups of 4 and 8 take more AG movers than pairs
  movers = lambda w, engine: {c.num_comm for c in select.default_candidates("ag", w, BF16, "9.0")
                              if c.engine == engine}
  for w in (4, 8):
    assert min(movers(w, "tl")) > max(movers(2, "tl"))
    assert min(movers(w, "gluon")) > min(movers(2, "gluon"))
  assert select.default_candidates("ag", 16, BF16) == select.default_candidates("ag", 8, BF16)
  assert select.default_candidates("ag", 3, BF16) == select.default_candidates("ag", 4, BF16)


@pytest.mark.parametrize("dtype", [BF16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_a_float32_product_of_narrower_operands_is_measured_in_tiles_that_hold_it(
    op, dtype):
  """dot_general(..., preferred_element_type=float32) of bf16 or fp8 operands: the Gluon
  GEMM+RS's 128x256 tiles cannot hold a float32 output tile (shared memory: it stages and
  sums the whole tile), so its fixed candidates take 128x128; the Gluon AG and the tl engine
  keep 128x256 (the AGs store the tile in column halves, tl's GEMM+RS sums and stores its own
  tiles so; whole, the AGs' buffers overflowed shared memory and GEMM+RS spilled).  A first
  call times both engines."""
  f32 = np.float32
  usual = select.default_kernel(dtype)
  assert select.default_kernel(dtype, f32, op) == usual
  assert select.unsupported(1024, 4096, 4096, dtype, f32, usual, op) is None
  gluon = dataclasses.replace(usual, engine="gluon")
  assert (select.unsupported(1024, 4096, 4096, dtype, f32, gluon, op) is None) == (op == "ag")
  gluon_tiles = dataclasses.replace(gluon, block_n=128) if op == "rs" else gluon
  assert select.wide_output_tiles(gluon, f32, op) == gluon_tiles
  assert select.wide_output_tiles(gluon, BF16, op) == gluon
  for w in (2, 4, 8):
    fixed = select.default_candidates(op, w, dtype, "9.0", f32)
    assert [c.engine for c in fixed] == [c.engine for c in
                                         select.default_candidates(op, w, dtype, "9.0")]
    assert all(select.unsupported(1024, 4096, 4096, dtype, f32, c, op) is None for c in fixed)
    assert {(c.engine, c.block_n) for c in fixed} == {("tl", 256), ("gluon", gluon_tiles.block_n)}
    for m in (8192, 1024, 128):  # large, and small enough for the narrow tiles and split-K
      rows = m // w
      v = (select.choose_ag(OverlapConfig(), H200, w, rows, 4096, 8192 // w, dtype, f32,
                            compute_capability="9.0") if op == "ag" else
           select.choose_rs(OverlapConfig(), H200, w, m, 4096 // w, 8192, dtype, f32,
                            compute_capability="9.0"))
      assert v.source == "first_call", v.reason
      assert {c.engine for c in v.candidates} == {"tl", "gluon"}
      k, n = (4096, 8192 // w) if op == "ag" else (4096 // w, 8192)
      for c in v.candidates:
        assert select.unsupported(rows, k, n, dtype, f32, c, op) is None


def test_first_call_candidates_ranked_by_the_model_and_pruned_by_the_resource_model():
  sizes = (2048, 8192, 5120)
  fit2 = cost_model.load(H200, 2, BF16)
  got, predicted = select.first_call_candidates("ag", fit2, 2, sizes, 2048, BF16, BF16, "9.0")
  top = [c for _, c in fit2.rank("ag", *sizes, select.candidate_configs("ag", fit2, BF16), 2)][
      :select.AUTOTUNE_CANDIDATES]
  fixed = select.default_candidates("ag", 2, BF16, "9.0")
  assert list(got) == (top + [c for c in fixed if c not in top])[:select.MAX_CANDIDATES]
  tl = [c for c in got if c.engine == "tl"]
  assert predicted == (fit2.rank("ag", *sizes, tl, 2)[0][0], fit2.unfused_ms("ag", *sizes, 2))
  derived = cost_model.load(H200, 8, BF16)  # extrapolated: orders the fixed list only
  got, predicted = select.first_call_candidates("ag", derived, 8, (1024, 8192, 1280), 1024,
                                                BF16, BF16, "9.0")
  assert set(got) == set(select.default_candidates("ag", 8, BF16, "9.0")) and predicted
  assert [c.engine for c in got] == ["tl", "tl", "gluon", "gluon"]
  got, predicted = select.first_call_candidates("ag", None, 4, sizes, 2048, BF16, BF16, None)
  assert got == select.default_candidates("ag", 4, BF16) and predicted is None
  # the resource model: what cannot run is never timed (here: K not a multiple of 64, which
  # the all-gather pushes in 64-column blocks); GEMM+RS takes it (TMA zero-fills the k-block)
  assert select.first_call_candidates("ag", None, 4, (2048, 1000, 64), 2048, BF16, BF16,
                                      "9.0") == ((), None)
  got, _ = select.first_call_candidates("rs", None, 8, (8192, 3696, 8192), 1024, BF16, BF16, "9.0")
  assert got == select.default_candidates("rs", 8, BF16, "9.0")
  v = select.choose_rs(OverlapConfig(), H200, 8, 8192, 3696, 8192, BF16, BF16,
                       compute_capability="9.0")
  assert v.source == "first_call" and v.candidates == got
  v = select.choose_ag(OverlapConfig(), H200, 8, 1024, 3696, 1024, BF16, BF16)
  assert v.kernel is None and "multiple of 64 (the all-gather" in v.reason


# --- cache keys and the kernel-source hash -------------------------------------------------

def test_verdicts_hold_for_the_kernel_sources_they_were_measured_with(monkeypatch, tmp_path):
  monkeypatch.setenv("JAX_AUTOOVERLAP_CACHE_DIR", str(tmp_path / "cache"))
  pkg = tmp_path / "pkg"
  for part in ("kernels", "backends"):
    shutil.copytree(store.PACKAGE / part, pkg / part)
  shutil.copy(store.PACKAGE / "_compat.py", pkg / "_compat.py")
  monkeypatch.setattr(store, "PACKAGE", pkg)
  store.kernel_hash.cache_clear()
  store.clear_cache()
  try:
    assert store.kernel_hash() == store.kernel_hash.__wrapped__()  # the same files, same hash
    key = select.cache_key("ag", H200, 4, 8192, 4096, 4096, BF16)
    entry = {"impl": "triton", "kernel": dataclasses.asdict(KernelConfig(chunks=2)),
             "source": "first_call", "note": "fused kernel 12.0 % faster (margin 1.0 %)",
             "ours_ms": 1.0, "unfused_ms": 1.2}
    path = store.record("ag", key, entry)
    assert json.loads(path.read_text())[key]["kernel_hash"] == store.kernel_hash()
    store.clear_cache()  # a new process reads it back
    v = select.choose_ag(ao.OverlapConfig(), H200, 4, 2048, 4096, 1024, BF16, BF16)
    assert v.source == "autotuned" and v.kernel == KernelConfig(chunks=2)
    # a kernel changes: the verdict no longer counts, and the planner says why
    before = store.kernel_hash()
    source = pkg / "kernels" / "gemm_rs.py"
    source.write_text(source.read_text() + "#\n")
    store.kernel_hash.cache_clear()
    store.clear_cache()
    assert store.kernel_hash() != before and key not in store.verdicts()
    assert store.stale()[key] == (f"measured with other kernel sources (hash {before}, these are "
                                  f"{store.kernel_hash()})")
    v = select.choose_ag(ao.OverlapConfig(), H200, 4, 2048, 4096, 1024, BF16, BF16)
    assert v.source == "first_call" and f"the cached verdict was measured with other kernel " \
        f"sources (hash {before}" in v.reason
    # a launcher counts as kernel source too; a file elsewhere does not
    h = store.kernel_hash()
    (pkg / "backends" / "launch.py").write_text("# changed\n")
    store.kernel_hash.cache_clear()
    assert store.kernel_hash() != h
    h = store.kernel_hash()
    (pkg / "reasons.py").write_text("# not a kernel\n")
    store.kernel_hash.cache_clear()
    assert store.kernel_hash() == h
  finally:
    store.kernel_hash.cache_clear()
    store.clear_cache()


def test_cache_key_names_kind_group_size_shape_and_dtype():
  assert select.cache_key("ag", H200, 8, 8192, 4096, 4096, BF16) == \
      "ag|NVIDIA H200|w8|8192x4096x4096|bfloat16"
  v = select.choose_ag(ao.OverlapConfig(), H200, 8, 1024, 4096, 512, BF16, BF16)
  r = select.choose_rs(ao.OverlapConfig(), H200, 8, 8192, 512, 4096, BF16, BF16)
  assert v.key == "ag|NVIDIA H200|w8|8192x4096x4096|bfloat16"  # the global M x K x N
  assert r.key == "rs|NVIDIA H200|w8|8192x4096x4096|bfloat16"
  # a product other than the default (the operands'; bf16 for fp8) is named
  r = select.choose_rs(ao.OverlapConfig(), H200, 8, 8192, 512, 4096, BF16, np.float32)
  assert r.key == "rs|NVIDIA H200|w8|8192x4096x4096|bfloat16->float32"
  e4 = jnp.float8_e4m3fn
  assert select.cache_key("ag", H200, 2, 64, 64, 64, e4, None, BF16).endswith("|float8_e4m3fn")
  assert select.cache_key("ag", H200, 2, 64, 64, 64, e4, None, np.float32).endswith(
      "|float8_e4m3fn->float32")


# --- planning and explain (CPU devices planned as GPUs, fake programs) ----------------------

@pytest.fixture
def gpu_planned(monkeypatch, stand_in_cuda_driver, tmp_path):
  """CPU meshes planned as GPUs of kind "cpu", a fresh cache, no verdicts; returns the record
  of the kernels traced (their unfused math stands in for them)."""
  from jax_autooverlap.runtime import context
  monkeypatch.setenv("JAX_AUTOOVERLAP_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(context, "platform", lambda mesh: None if mesh is None else "gpu")
  store.clear_cache()
  yield stand_in_kernels(monkeypatch)
  store.clear_cache()


def fake_programs(monkeypatch, ms_of):
  """measure's programs replaced: ms_of(kernel | None) -> ms per call, or an exception to raise
  at compile; returns the kernels compiled (None: the unfused program)."""
  compiled = []

  @dataclasses.dataclass
  class Program:
    label: str
    case: object
    core_name: str
    cp: object

    def compile(self):
      kernel = self.cp.gpu.kernel if self.cp.gpu else None
      compiled.append(kernel)
      self.ms = ms_of(kernel)
      if isinstance(self.ms, Exception):
        raise self.ms

    def check(self):
      pass

    def time(self, iters):
      return self.ms

  monkeypatch.setattr(measure, "_Program", Program)
  monkeypatch.setattr(measure, "_Case", lambda *a: None)
  return compiled


def test_first_call_measures_once_records_and_explain_never_measures(gpu_planned, monkeypatch,
                                                                   tmp_path, capsys):
  mesh, sizes = cpu_mesh((2,), ("x",)), (1, 2048, 8192, 5120)
  pick = select.choose_ag(ao.OverlapConfig(), "cpu", 2, 2048, 8192, 5120, BF16, BF16)
  second = pick.candidates[1]
  compiled = fake_programs(monkeypatch, lambda k: 1.0 if k is None else 0.5 if k == second else 0.8)
  impl, _, why = plan("ag_rows", ao.OverlapConfig(), 2, sizes, BF16, BF16, mesh)  # explain's
  assert compiled == [] and impl == "unfused" and why.code == "first_call"
  impl, gpu, why = plan("ag_rows", ao.OverlapConfig(), 2, sizes, BF16, BF16, mesh, axis_name="x",
                        may_time=True)
  # each once (compiled concurrently: any order)
  assert collections.Counter(compiled) == collections.Counter([None, *pick.candidates])
  assert impl == "triton" and gpu.kernel == second and why.code == "kernel"
  assert "autotuned: fused kernel 50.0 % faster (margin 1.0 %); 0.500 ms vs unfused 1.000" in why
  err = capsys.readouterr().err
  assert "[jax_autooverlap] timing ag 4096x8192x10240 bf16 on 2 GPUs: unfused + 2 candidates" in err
  assert "fused kernel 50.0 % faster" in err and "recorded in" in err
  (entry,) = json.loads((tmp_path / "tuning-ag.json").read_text()).values()
  assert entry["source"] == "first_call" and KernelConfig(**entry["kernel"]) == second
  assert entry["ours_ms"] == 0.5 and entry["unfused_ms"] == 1.0 and entry["rounds"] == 7
  assert entry["kernel_hash"] == store.kernel_hash() and entry["processes"] == 1
  impl, gpu, _ = plan("ag_rows", ao.OverlapConfig(), 2, sizes, BF16, BF16, mesh, axis_name="x",
                      may_time=True)
  assert len(compiled) == 3 and gpu.kernel == second  # measured once only
  # off per call, or everywhere: no measurement (no model for "cpu": unfused)
  compiled.clear()
  other = (1, 4096, 8192, 5120)
  impl, _, why = plan("ag_rows", ao.OverlapConfig(autotune=False), 2, other, BF16, BF16, mesh,
                      axis_name="x", may_time=True)
  assert impl == "unfused" and why.code == "never_measured" and compiled == []
  monkeypatch.setenv("JAX_AUTOOVERLAP_AUTOTUNE", "off")
  impl, _, why = plan("ag_rows", ao.OverlapConfig(), 2, other, BF16, BF16, mesh, axis_name="x",
                      may_time=True)
  assert impl == "unfused" and why.code == "never_measured" and compiled == []


def test_a_float32_product_has_its_own_verdict(gpu_planned, monkeypatch, tmp_path):
  """The same sizes with a float32 product (preferred_element_type=float32) are measured on
  their own, in their own tiles, and keyed "bfloat16->float32": the bf16 product's verdict
  (128x256 tiles, which on the Gluon engine cannot hold a float32 tile) never answers for
  them."""
  mesh, sizes = cpu_mesh((2,), ("x",)), (1, 2048, 8192, 5120)
  compiled = fake_programs(monkeypatch, lambda k: 1.0 if k is None else 0.5)
  impl, gpu, _ = plan("ag_rows", ao.OverlapConfig(), 2, sizes, BF16, BF16, mesh, axis_name="x",
                      may_time=True)
  assert impl == "triton" and gpu.kernel.block_n == 256
  compiled.clear()
  impl, gpu, why = plan("ag_rows", ao.OverlapConfig(), 2, sizes, BF16, np.float32, mesh,
                        axis_name="x", may_time=True)
  assert None in compiled and len(compiled) > 1  # measured again, not the bf16 verdict
  assert impl == "triton", why
  kernels = [k for k in compiled if k is not None] + [gpu.kernel]
  assert all(select.unsupported(2048, 8192, 5120, BF16, np.float32, k) is None for k in kernels)
  assert measure.describe_call("ag_rows", 2, sizes[1:], BF16, None, np.float32) == \
      "ag 4096x8192x10240 bf16 -> f32 on 2 GPUs"
  keys = set(json.loads((tmp_path / "tuning-ag.json").read_text()))
  assert keys == {"ag|cpu|w2|4096x8192x10240|bfloat16",
                  "ag|cpu|w2|4096x8192x10240|bfloat16->float32"}


def test_a_unfused_verdict_and_a_failed_measurement(gpu_planned, monkeypatch, tmp_path):
  mesh = cpu_mesh((2,), ("x",))
  compiled = fake_programs(monkeypatch, lambda k: 0.2 if k is None else 0.3)
  impl, _, why = plan("rs_rows", ao.OverlapConfig(), 2, (1, 8192, 4096, 8192), BF16, BF16, mesh,
                      axis_name="x", may_time=True)
  assert impl == "unfused" and why.code == "tuner_unfused"
  assert "autotuned: unfused program kept: fused kernel 50.0 % slower" in why
  assert len(json.loads((tmp_path / "tuning-rs.json").read_text())) == 1
  # the agreement fails (a process did not answer): unfused, nothing recorded on disk, and this
  # process does not measure the shape again
  monkeypatch.setattr(measure._Agreement, "conclude",
                      lambda self, ok, why: (False, "process 1: timed out"))
  compiled.clear()
  sizes = (1, 4096, 4096, 8192)
  for _ in range(2):
    impl, _, why = plan("rs_rows", ao.OverlapConfig(), 2, sizes, BF16, BF16, mesh, axis_name="x",
                        may_time=True)
    assert impl == "unfused" and why.code == "measure_failed" and "process 1: timed out" in why
  assert len(compiled) == 1 + len(select.default_candidates("rs", 2, BF16))
  assert len(json.loads((tmp_path / "tuning-rs.json").read_text())) == 1


def _ag_rs(mesh):
  def block(x, w):
    h = lax.all_gather(x, "x", axis=0, tiled=True) @ w
    return lax.psum_scatter(h @ w.T, "x", scatter_dimension=0, tiled=True)
  return jax.shard_map(block, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))


def test_explain_says_what_the_first_call_measures_and_then_what_it_measured(gpu_planned,
                                                                             monkeypatch):
  mesh = cpu_mesh((2,), ("x",))
  compiled = fake_programs(monkeypatch, lambda k: 1.0 if k is None else 0.7)
  x = jax.device_put(jnp.ones((256, 128), BF16), NamedSharding(mesh, P("x")))
  w = jax.device_put(jnp.ones((128, 128), BF16), NamedSharding(mesh, P()))
  f = ao.jit(_ag_rs(mesh))
  # a small shape: two usual candidates and the narrower tiles and split-K (tl off sm_90)
  n_ag = len(select.first_call_candidates("ag", None, 2, (128, 128, 128), 128, BF16, BF16)[0])
  n_rs = len(select.first_call_candidates("rs", None, 2, (256, 128, 128), 128, BF16, BF16)[0])
  for report in (f.explain(x, w), ao.explain(f, x, w)):
    assert [m.status for m in report] == ["pending", "pending"] and compiled == []
    assert all(m.code == "first_call" and m.rewritten for m in report), str(report)
    for n in (n_ag, n_rs):
      assert f"measured on the first call: the unfused program and {n} kernel configs" in str(
          report)
  step = jax.jit(lambda x, w: f(x, w) * 2)  # explain of a program calling the ao.jit function
  assert [m.status for m in ao.explain(step, x, w)] == ["pending", "pending"] and compiled == []
  np.testing.assert_allclose(np.asarray(f(x, w), np.float32), 2 * 128 * 128)
  assert len(compiled) == 2 + n_ag + n_rs  # the first call measured both ops (unfused + each)
  report = f.explain(x, w)  # not the explain trace from before: what the call measured
  assert [m.status for m in report] == ["fused", "fused"], str(report)
  assert all(m.impl.startswith("triton kernel (autotuned: fused kernel 30.0 % faster")
             for m in report)
  np.testing.assert_allclose(np.asarray(step(x, w), np.float32), 4 * 128 * 128)
  assert len(compiled) == 2 + n_ag + n_rs  # a new program measures nothing known


# --- the whole path on CPU devices: real programs, checks and timing ------------------------

def test_first_call_times_real_programs_from_inside_a_jit_trace(gpu_planned, monkeypatch, tmp_path):
  """ao.jit traces, the planner compiles, checks and times separate programs in a worker thread
  (the unfused program; the 'kernels' are the unfused math), agrees (one process), records; a
  candidate whose result is off the reference is dropped."""
  monkeypatch.setattr(autotune, "ROUNDS", 3)
  monkeypatch.setattr(autotune, "ROUND_MS", 1.0)
  from jax_autooverlap.ops import registry
  impls = registry.core("ag_rows").impls
  good = impls["triton"].run
  broken = select.default_candidates("ag", 2, BF16)[1]

  events = []  # the kernels' modules are imported before the concurrent compiles trace them
  monkeypatch.setattr(backends, "load_kernels", lambda: events.append("load"))

  def run(a, b, cp, need_gathered, scale=None):  # as registry.dispatch and measure call it
    events.append("trace")
    out = good(a, b, cp, need_gathered, scale)
    if cp.gpu.kernel == broken:  # a wrong kernel: its result is off
      return (out[0] * 1.5, *out[1:]) if isinstance(out, tuple) else out * 1.5
    return out

  monkeypatch.setitem(impls, "triton", dataclasses.replace(impls["triton"], run=run))
  mesh = cpu_mesh((2,), ("x",))
  f = jax.shard_map(lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w, mesh=mesh,
                    in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
  x = jax.device_put(jnp.ones((256, 128), BF16), NamedSharding(mesh, P("x")))
  w = jax.device_put(jnp.ones((128, 256), BF16), NamedSharding(mesh, P(None, "x")))
  out = ao.jit(f)(x, w)
  np.testing.assert_allclose(np.asarray(out, np.float32), 128.0)
  (entry,) = json.loads((tmp_path / "tuning-ag.json").read_text()).values()
  assert entry["source"] == "first_call" and entry["unfused_ms"] > 0 and entry["rounds"] == 3
  failed = entry["failed"]
  assert list(failed) == [f"tl chunks={broken.chunks} movers={broken.num_comm}"]
  assert "result off the reference" in next(iter(failed.values()))
  kernels = {k for _, k in gpu_planned}
  assert kernels >= set(select.default_candidates("ag", 2, BF16))  # both compiled and checked
  assert events[0] == "load" and "trace" in events


def test_first_call_measures_fp8_matmuls_within_the_formats_bound(gpu_planned, monkeypatch,
                                                                  tmp_path):
  """An fp8 matmul (e4m3 operands, the scales on its bf16 result) is measured on its first call
  like a 16-bit one: fp8 candidates (K tiles of 128) against the unfused program, each
  checked against the f32 product of its fp8 operands within fp8.gemm_tolerance."""
  monkeypatch.setattr(autotune, "ROUNDS", 3)
  monkeypatch.setattr(autotune, "ROUND_MS", 1.0)
  e4 = jnp.float8_e4m3fn
  mesh = cpu_mesh((2,), ("x",))

  def body(x, w, s):
    g = lax.all_gather(x, "x", axis=0, tiled=True)
    return lax.dot_general(g, w, (((1,), (0,)), ((), ())),
                           preferred_element_type=BF16) * s.astype(BF16)
  f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x"), P()),
                    out_specs=P(None, "x"))
  x = jax.device_put(jnp.ones((256, 256), e4), NamedSharding(mesh, P("x")))
  w = jax.device_put(jnp.ones((256, 256), e4), NamedSharding(mesh, P(None, "x")))
  out = ao.jit(f)(x, w, jnp.float32(0.5))
  np.testing.assert_allclose(np.asarray(out, np.float32), 128.0)
  (key, entry), = json.loads((tmp_path / "tuning-ag.json").read_text()).items()
  assert key.endswith("float8_e4m3fn") and entry["source"] == "first_call", (key, entry)
  assert not entry.get("failed") and entry["unfused_ms"] > 0  # every candidate passed its check
  kernels = [k for _, k in gpu_planned if k is not None]
  assert kernels and all(k.block_k == 128 for k in kernels)
  # the bound is the formats' (a few 1e-3 at this K)
  assert measure.tolerance(e4, BF16, 256) < 0.01


def test_first_call_measures_a_float32_product_of_bf16_operands(gpu_planned, monkeypatch,
                                                                 tmp_path):
  """ao.jit of a TP block whose matmuls give float32 (preferred_element_type): both fused ops
  are measured on their first call (tl: the stand-in GPUs are not sm_90) in tiles that hold
  a float32 tile (128x256 unsplit, and at this small M the narrow ones and split-K in 128x128
  or fewer elements), every candidate checked against the f32 product (none fails), and the
  result is the unfused program's."""
  monkeypatch.setattr(autotune, "ROUNDS", 3)
  monkeypatch.setattr(autotune, "ROUND_MS", 1.0)
  mesh = cpu_mesh((2,), ("x",))

  def body(x, w1, w2):
    h = lax.dot(lax.all_gather(x, "x", axis=0, tiled=True), w1, preferred_element_type=np.float32)
    y = lax.dot(h.astype(BF16), w2, preferred_element_type=np.float32)
    return lax.psum_scatter(y, "x", scatter_dimension=0, tiled=True)
  f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x"), P("x")), out_specs=P("x"))
  k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
  put = lambda a, spec: jax.device_put(a.astype(BF16), NamedSharding(mesh, spec))
  x = put(jax.random.normal(k1, (256, 128)), P("x"))
  w1 = put(jax.random.normal(k2, (128, 256)) / 16, P(None, "x"))
  w2 = put(jax.random.normal(k3, (256, 128)) / 16, P("x"))
  out = ao.jit(f)(x, w1, w2)
  want = jax.jit(f)(x, w1, w2)
  assert out.dtype == np.float32
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-2, atol=2e-2)
  for op in ("ag", "rs"):
    (key, entry), = json.loads((tmp_path / f"tuning-{op}.json").read_text()).items()
    assert key.endswith("|bfloat16->float32") and not entry.get("failed"), (key, entry)
  kernels = [k for _, k in gpu_planned if k is not None]
  assert {k.engine for k in kernels} == {"tl"}  # (the stand-in GPUs are not sm_90: no Gluon)
  assert {(128, 256), (128, 128)} <= {(k.block_m, k.block_n) for k in kernels}
  assert all(k.block_m * k.block_n <= 128 * 128 for k in kernels
             if k.split_k > 1 or k.pack_shards)


def test_a_mixed_format_fp8_matmul_is_measured_in_both_its_formats(gpu_planned, monkeypatch,
                                                                   tmp_path, capsys):
  """The backward's e5m2 cotangent times e4m3 weights: the first call times and checks the
  candidates on operands in those two formats (the kernel that then runs), not both in the
  first operand's; the verdict is keyed by both formats (an e5m2 x e5m2 call of the same sizes
  is measured on its own), and explain finds it."""
  monkeypatch.setattr(autotune, "ROUNDS", 3)
  monkeypatch.setattr(autotune, "ROUND_MS", 1.0)
  e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  made = []
  real_case = measure._Case

  def spy(*args):
    case = real_case(*args)
    made.append(case)
    return case
  monkeypatch.setattr(measure, "_Case", spy)
  mesh = cpu_mesh((2,), ("x",))

  def body(x, w):
    g = lax.all_gather(x, "x", axis=0, tiled=True)
    return lax.dot_general(g, w, (((1,), (0,)), ((), ())), preferred_element_type=BF16)
  f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
  x = jax.device_put(jnp.ones((256, 256), e5), NamedSharding(mesh, P("x")))
  w = jax.device_put(jnp.ones((256, 256), e4), NamedSharding(mesh, P(None, "x")))
  np.testing.assert_allclose(np.asarray(ao.jit(f)(x, w), np.float32), 256.0)
  (case,) = made
  assert [a.dtype for a in case.args(0)] == [np.dtype(e5), np.dtype(e4)]
  assert "timing ag 256x256x256 float8_e5m2 x float8_e4m3fn on 2 GPUs" in capsys.readouterr().err
  (key, entry), = json.loads((tmp_path / "tuning-ag.json").read_text()).items()
  assert key.endswith("|float8_e5m2xfloat8_e4m3fn") and entry["source"] == "first_call"
  assert not entry.get("failed")  # every candidate passed its check on the mixed operands
  (row,) = ao.explain(f, x, w)  # the measured verdict (fused or not: CPU timings)
  assert "autotuned" in row.impl and row.code != "first_call", str(row)
  assert select.cache_key("ag", "k", 2, 256, 256, 256, e5) != key  # e5m2 x e5m2: its own
  assert select.cache_key("ag", "k", 2, 256, 256, 256, e5, e5) == select.cache_key(
      "ag", "k", 2, 256, 256, 256, e5)
  # the two formats' blocks differ, and the reference is their f32 product
  a, b = (np.asarray(v, np.float32) for v in case.args(1))
  for d in mesh.devices.flat:
    index = NamedSharding(mesh, case.out_spec).devices_indices_map(case.out_shape)[d]
    np.testing.assert_allclose(np.asarray(case.reference(1, d)), (a @ b)[index], rtol=1e-5)


def test_reference_blocks_are_this_devices_block_of_the_product():
  mesh = cpu_mesh((2, 2), ("dp", "x"))
  for op, sizes in (("ag_rows", (64, 128, 32)), ("rs_rows", (128, 64, 32))):
    case = measure._Case(op, mesh, "x", sizes, np.float32, np.float32)
    a, b = (np.asarray(v) for v in case.args(1))
    want = a @ b
    for d in mesh.devices.flat:
      index = NamedSharding(mesh, case.out_spec).devices_indices_map(case.out_shape)[d]
      np.testing.assert_allclose(np.asarray(case.reference(1, d)), want[index], rtol=1e-5,
                                 atol=1e-4)
  assert measure.tolerance(BF16, BF16) == 2e-2 and measure.tolerance(BF16, np.float32) == 2e-2


def test_processes_sharing_a_gpu_skip_the_unfused_program_up_front(monkeypatch):
  """Processes that share a GPU (told apart by UUID, not by their ordinals) cannot run the
  unfused program (NCCL refuses them, slowly): measure.shared_gpus says so before anything is
  compiled, and that program fails at once with the reason."""
  from types import SimpleNamespace as NS
  monkeypatch.setattr(measure.jax, "process_index", lambda: 0)
  uuid_of = {0: "aa"}
  monkeypatch.setattr(measure.cuda, "device_uuid", lambda ordinal: uuid_of[ordinal])
  gpu = lambda p: NS(process_index=p, platform="gpu", local_hardware_id=0)
  mesh = NS(devices=np.array([gpu(0), gpu(1)]))

  class Agreement:
    def __init__(self, others):
      self.others, self.steps = others, []

    def exchange(self, step, payload):
      self.steps.append(step)
      return {0: payload, 1: self.others}

  same = Agreement(["aa"])
  assert "1 GPU(s) of the mesh are shared by several processes" in measure.shared_gpus(mesh, same)
  assert same.steps == ["gpus"]
  assert measure.shared_gpus(mesh, Agreement(["bb"])) is None  # both ordinal 0, two GPUs
  cpu = NS(devices=np.array([NS(process_index=0, platform="cpu", local_hardware_id=0)]))
  quiet = Agreement(["aa"])
  assert measure.shared_gpus(cpu, quiet) is None and quiet.steps == []  # nothing exchanged
  program = measure._Program("unfused", None, "ag_rows", None, not_run="2 GPUs shared")
  with pytest.raises(RuntimeError, match="not run: 2 GPUs shared"):
    program.compile()


def test_failed_small_shape_candidates_keep_one_entry_each():
  """A verdict names each failed candidate by engine, chunks, movers and what differs from the
  default tiles: small-shape candidates share the first three, and one failure must not hide
  another."""
  base = KernelConfig(chunks=4, num_comm=32)
  cands = [base, dataclasses.replace(base, block_m=64, num_warps=8),
           dataclasses.replace(base, block_m=128, block_n=128, split_k=8, pack_shards=True)]
  outcome = autotune.Outcome(choice=None, note="all failed", ours_ms=None, unfused_ms=1.0,
                             margin=None, failed={"0": "a", "1": "b", "2": "c"})
  failed = autotune.entry_of(outcome, cands, "2026-12-02", 1, 3)["failed"]
  assert failed == {"tl chunks=4 movers=32": "a", "tl chunks=4 movers=32 tiles=64x256": "b",
                    "tl chunks=4 movers=32 tiles=128x128 split_k=8 packed": "c"}
