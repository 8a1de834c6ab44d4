"""The package's imports flow one way: api -> rewrite -> ops -> backends -> kernels, with
tuning and runtime below them and the leaves (_compat, reasons, fp8) at the bottom; bench sits
beside (it may import anything; nothing imports it).  No import circles, lazy imports too."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "jax_autooverlap"
# Higher imports lower; equal ranks only within one sub-package.
RANKS = {"demo": 9, "bench": 8, "": 7, "api": 6, "rewrite": 5, "ops": 4, "backends": 3,
         "kernels": 2, "tuning": 1, "runtime": 1, "_compat": 0, "reasons": 0, "fp8": 0}


def _modules():
  out = {}
  for path in PKG.rglob("*.py"):
    parts = ("jax_autooverlap",) + path.relative_to(PKG).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _edges(mods):
  """module -> the package modules it imports (every import statement, at any depth)."""
  edges = {m: set() for m in mods}
  for m, path in mods.items():
    pkg = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
        targets = [base] + [f"{base}.{a.name}" for a in node.names]
      else:
        continue
      for t in targets:
        while t and t not in mods:
          t = t.rpartition(".")[0]
        # a package's __init__ importing its own modules, or a module its own package: not edges
        if t and t != m and not (mods[t].name == "__init__.py" and m.startswith(t + ".")):
          edges[m].add(t)
  return edges


def _area(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def _circles(edges):
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      scc = []
      while True:
        w = stack.pop()
        on.discard(w)
        scc.append(w)
        if w == v:
          break
      if len(scc) > 1:
        out.append(sorted(scc))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


@pytest.fixture(scope="module")
def edges():
  mods = _modules()
  assert set(map(_area, mods)) <= set(RANKS), "a new sub-package needs a rank in RANKS"
  return _edges(mods)


def test_no_import_circles(edges):
  assert _circles(edges) == []


def _upward(edges):
  return sorted(f"{m} -> {t}" for m, ts in edges.items() for t in ts
                if _area(m) != _area(t) and RANKS[_area(t)] >= RANKS[_area(m)])


def test_imports_flow_down(edges):
  assert _upward(edges) == []


def test_nothing_imports_bench(edges):
  assert sorted(f"{m} -> {t}" for m, ts in edges.items() for t in ts
                if _area(t) == "bench" and _area(m) != "bench") == []


def test_the_checks_catch_a_circle_and_an_upward_import():
  edges = {"jax_autooverlap.ops.a": {"jax_autooverlap.api"},
           "jax_autooverlap.api": {"jax_autooverlap.ops.a"}}
  assert _circles(edges) == [["jax_autooverlap.api", "jax_autooverlap.ops.a"]]
  assert _upward(edges) == ["jax_autooverlap.ops.a -> jax_autooverlap.api"]
