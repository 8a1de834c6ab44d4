"""The end-to-end training benchmark (`python -m jax_autooverlap.bench model`) on 8 CPU devices.

CPU timings mean nothing here; what is checked is that every implementation
trains the same model from the same state to the same losses, that the
records carry what the GPU runs will be judged by, and the sizes the default
depth and MFU are computed from.
"""
import json
import math
import os
import pathlib
import subprocess
import sys
import unittest.mock

import pytest

from conftest import notebook_cell
from jax_autooverlap.bench.model import cli, llama, runner

ROOT = pathlib.Path(__file__).parents[1]

RECORD_KEYS = {"bench", "model", "tokens", "world_size", "impl", "step_ms", "tokens_per_s", "mfu",
               "loss", "fused", "skipped", "versions", "gpu", "variant", "mesh", "layers", "seq",
               "batch"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  """One --smoke run (both variants, all three implementations): (rc, stdout, records, path)."""
  out = tmp_path_factory.mktemp("model-results")
  with unittest.mock.patch("sys.stdout", new_callable=__import__("io").StringIO) as stdout:
    rc = cli.main(["--smoke", "--out", str(out)])
  paths = sorted(out.glob("*-model.json"))
  assert len(paths) == 1, paths
  return rc, stdout.getvalue(), json.loads(paths[0].read_text()), paths[0]


def _rows(records, variant):
  return {r["impl"]: r for r in records if r.get("variant") == variant}


def test_smoke_tensor_parallel_trains_identically_under_every_impl(smoke):
  rc, stdout, records, path = smoke
  assert rc == 0, stdout
  assert path.name.startswith("cpu-x8-") and path.name.endswith("-model.json")
  rows = _rows(records, "tp")
  assert set(rows) == set(runner.IMPLS)
  ref = rows["jax.jit"]
  assert "error" not in ref, ref.get("error")
  assert len(ref["loss"]) == 2 and all(math.isfinite(v) and v > 0 for v in ref["loss"])
  for impl, r in rows.items():
    assert "error" not in r, (impl, r.get("error"))
    assert RECORD_KEYS <= set(r), RECORD_KEYS - set(r)
    assert r["bench"] == "model" and r["model"] == "tiny" and r["world_size"] == 8
    assert r["platform"] == "cpu"
    assert r["mesh"] == "tp=8" and r["seq"] * r["batch"] == r["tokens"] == 256
    assert r["step_ms"] > 0
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_ms"] * 1e3, rel=1e-3)
    assert r["mfu"] is None  # no peak known for a CPU
    assert (r["fused"] is None) == (impl != "ao.jit")
    if impl != "jax.jit":
      assert r["loss_agrees"] is True, (impl, r["loss"], ref["loss"])
      assert r["loss_rel_diff"] <= 2e-2
  # the XLA-flag variant lists its flags; ao.jit reports what the rewrite fused
  assert "xla_gpu_threshold_for_windowed_einsum_mib=0" in rows["jax.jit+xla_overlap"]["xla_flags"]
  ao = rows["ao.jit"]
  assert ao["fused"] >= 4  # at least the forward layer's 2 gathers and 2 scatters
  assert ao["skipped"] == 0, ao["skip_reasons"]
  assert set(ao["fused_impls"]) == {"reference ring (chunked ppermute) on cpu"}


def test_smoke_fsdp_variant_runs_or_is_an_error_row(smoke):
  """The FSDP x sequence-parallel rewrite may still fail: then ao.jit is an error row and the
  run goes on; the jax.jit variants always train."""
  _, _, records, _ = smoke
  rows = _rows(records, "fsdp")
  assert set(rows) == set(runner.IMPLS)
  for impl in ("jax.jit", "jax.jit+xla_overlap"):
    assert "error" not in rows[impl], rows[impl].get("error")
    assert rows[impl]["mesh"] == "fsdp=2,tp=4"
  assert rows["jax.jit+xla_overlap"]["loss_agrees"] is True
  ao = rows["ao.jit"]
  if "error" in ao:
    assert ao["error"] and "step_ms" not in ao
  else:
    assert ao["loss_agrees"] is True and ao["fused"] >= 4


def test_smoke_prints_table_last_and_says_cpu_shows_no_gains(smoke):
  _, stdout, records, path = smoke
  lines = stdout.strip().splitlines()
  assert lines[-1] == f"wrote {path}"
  assert any(line.split()[:3] == ["tiny", "256", "tp"] and "ao.jit" in line for line in lines)
  assert "CPU timings show no overlap gains" in stdout
  assert all(r.get("note") == cli.CPU_NOTE for r in records)


def test_notebook_cell_tabulates_gpu_model_results_only(smoke, tmp_path, monkeypatch, capsys):
  """The notebook's model-results cell reads the JSON (and says so when there is none), and
  leaves CPU runs out: their timings cannot show overlap, beside GPU runs they would mislead."""
  cell = notebook_cell("-model*.json")
  monkeypatch.chdir(tmp_path)
  exec(cell, {})
  assert "no *-model*.json results" in capsys.readouterr().out
  results = tmp_path / "bench" / "results"
  results.mkdir(parents=True)
  (results / smoke[3].name).write_text(smoke[3].read_text())  # the CPU smoke run
  plt = unittest.mock.MagicMock()
  plt.subplots.return_value = (unittest.mock.MagicMock(), unittest.mock.MagicMock())
  monkeypatch.setitem(sys.modules, "matplotlib", unittest.mock.MagicMock(pyplot=plt))
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
  exec(cell, {})
  out = capsys.readouterr().out
  timed = [r for r in smoke[2] if r.get("tokens_per_s")]
  assert f"{len(timed)} records of CPU runs left out" in out and "no *-model*.json" in out
  assert not plt.show.called
  gpu_run = [{**r, "gpu": "NVIDIA-H200", "platform": "gpu"} for r in smoke[2]]  # as a GPU run
  (results / "NVIDIA-H200-x8-2026-01-01-model.json").write_text(json.dumps(gpu_run))
  exec(cell, {})
  out = capsys.readouterr().out
  row = next(line for line in out.splitlines() if " tp " in line and "tiny" in line)
  assert "NVIDIA-H200 x8" in row
  tp = _rows(smoke[2], "tp")
  best = max(tp["jax.jit"]["tokens_per_s"], tp["jax.jit+xla_overlap"]["tokens_per_s"])
  assert float(row.split()[-1]) == pytest.approx(tp["ao.jit"]["tokens_per_s"] / best, abs=1e-3)
  assert plt.show.called


def test_xla_flags_through_a_child_process(tmp_path, capsys):
  """Flags XLA does not take as compiler options go to a child process's XLA_FLAGS."""
  rc = cli.main(["--smoke", "--variants", "tp", "--impls", "jax.jit,jax.jit+xla_overlap",
                   "--steps", "1", "--xla-flags-via", "env", "--out", str(tmp_path),
                   "--tag", "child"])
  assert rc == 0
  rows = _rows(json.loads(next(tmp_path.glob("cpu-x8-*-model-child.json")).read_text()), "tp")
  child = rows["jax.jit+xla_overlap"]
  assert "error" not in child, child.get("error")
  assert child["xla_flags_via"] == "XLA_FLAGS (child process)"
  assert child["loss_agrees"] is True and child["loss"][0] == rows["jax.jit"]["loss"][0]


def test_loss_check_flags_disagreement():
  ref = {"loss": [2.0, 1.9], "all_finite": True}
  close = {"loss": [2.0, 1.9 * (1 + 5e-3)], "all_finite": True}
  far = {"loss": [2.0, 1.5], "all_finite": True}
  nan = {"loss": [2.0, 1.9], "all_finite": False}
  for rec, agrees in ((close, True), (far, False), (nan, False)):
    runner.loss_check(rec, ref, 2e-2)
    assert rec["loss_agrees"] is agrees, rec
  assert far["loss_rel_diff"] == pytest.approx(0.4 / 1.9, rel=1e-2)


def test_llama_layer_sizes_match_the_published_models():
  """Llama-3 8B / 70B: 8.03e9 / 70.6e9 parameters, of which the 128256-token embedding and
  LM head are 2 x 128256 x hidden; the rest is 32 / 80 layers (+ a final norm)."""
  for name, total in (("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9)):
    d = llama.MODELS[name]
    layers = total - 2 * 128256 * d.hidden
    assert d.max_layers * llama.layer_param_count(d) == pytest.approx(layers, rel=5e-3)


def test_model_flops_and_default_depth():
  d = llama.MODELS["llama3-70b"]
  c = llama.make_config(d, 10, 8192, 4096, "tp", 2, 2)
  n = 10 * (llama.layer_param_count(d) - 2 * d.hidden)
  attn = 3 * 10 * 2 * c.batch * 4096**2 * d.heads * d.head_dim
  assert llama.model_flops_per_step(c) == pytest.approx(6 * n * 8192 + attn)
  fit = llama.layers_that_fit(c, 0.9 * 141e9, "cudnn")
  assert 1 <= fit < d.max_layers  # 70B does not fit on 2 GPUs whole
  assert llama.memory_estimate_bytes(c, fit, "cudnn") <= 0.9 * 141e9
  assert llama.memory_estimate_bytes(c, fit + 1, "cudnn") > 0.9 * 141e9
  assert llama.layers_that_fit(c, 1e15, "cudnn") == d.max_layers
  # sharding over more devices fits more layers
  c8 = llama.make_config(d, 10, 8192, 4096, "tp", 8, 2)
  assert llama.layers_that_fit(c8, 0.9 * 141e9, "cudnn") > fit


def test_configs_that_cannot_be_built_say_why():
  d = llama.MODELS["llama3-8b"]
  with pytest.raises(ValueError, match=r"kv_heads=8 is not divisible by tp=16"):
    llama.make_config(d, 1, 4096, 4096, "tp", 16, 2)
  with pytest.raises(ValueError, match=r"world size 6 is not divisible by fsdp=4"):
    llama.make_config(d, 1, 4096, 4096, "fsdp", 6, 4)
  c = llama.make_config(d, 1, 4096, 4096, "fsdp", 8, 2)  # batch 1 -> two 2048-token sequences
  assert (c.seq, c.batch, c.tp, c.fsdp) == (2048, 2, 4, 2)


def test_a_variant_that_does_not_apply_is_an_na_row_and_smoke_output_stays_out_of_the_repo(
    tmp_path, monkeypatch, capsys):
  """fsdp=3 cannot split 8 devices: an "n/a" row with the reason, not an ERROR; without --out a
  --smoke run writes into a new temporary directory, not bench/results/."""
  import tempfile
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  assert cli.main(["--smoke", "--variants", "fsdp", "--fsdp", "3"]) == 0
  out = capsys.readouterr().out
  assert "ERROR" not in out
  assert "n/a [1]" in out and "n/a: fsdp: world size 8 is not divisible by fsdp=3" in out
  path = pathlib.Path(out.strip().splitlines()[-1].removeprefix("wrote "))
  assert path.parent.parent == tmp_path / "tmp" and not (tmp_path / "bench").exists()
  (rec,) = json.loads(path.read_text())
  assert rec["not_applicable"] == "fsdp: world size 8 is not divisible by fsdp=3"
  assert "error" not in rec


def test_smoke_sets_up_eight_cpu_devices_itself(tmp_path):
  """`python -m jax_autooverlap.bench model --smoke` without XLA_FLAGS: 8 virtual CPU devices,
  as the demo has (one device would leave nothing to shard)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, "-m", "jax_autooverlap.bench", "model", "--smoke",
                         "--variants", "tp", "--impls", "jax.jit", "--steps", "1", "--warmup", "0",
                         "--loss-steps", "1", "--out", str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  (path,) = tmp_path.glob("cpu-x8-*-model.json")
  (rec,) = json.loads(path.read_text())
  assert rec["world_size"] == 8 and rec["mesh"] == "tp=8" and "error" not in rec
