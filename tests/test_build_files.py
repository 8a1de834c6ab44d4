"""BUILD and MODULE.bazel name what pyproject.toml ships and tests, and csrc/ configures.

Bazel cannot fetch its rules here, so the Starlark files are read as Python syntax (they use
no construct outside it) and their globs matched against the repository's files.
"""
import ast
import pathlib
import re
import shutil
import subprocess
import tomllib

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).parents[1]


def _parse(name):
  return ast.parse((ROOT / name).read_text(), filename=name)


def _calls(tree, name):
  """Every call of `name` (a function, or `x.name` for a method)."""
  def called(node):
    f = node.func
    return (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None)
  return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and called(n) == name]


def _kw(call, name):
  return next((k.value for k in call.keywords if k.arg == name), None)


def _rule(tree, kind, name):
  (call,) = [c for c in _calls(tree, kind) if ast.literal_eval(_kw(c, "name")) == name]
  return call


def _glob_regex(pattern):
  """Bazel glob pattern -> regex: `**/` any directories, `*` within one path segment."""
  out = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
  return re.compile(out.replace(r"\*", "[^/]*") + "$")


def _matchers(node):
  """(include, exclude) regexes of a label-list expression: string lists, glob(...), and sums."""
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
    (ai, ae), (bi, be) = _matchers(node.left), _matchers(node.right)
    return ai + bi, ae + be
  if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "glob":
    exclude = _kw(node, "exclude")
    return ([_glob_regex(p) for p in ast.literal_eval(node.args[0])],
            [_glob_regex(p) for p in (ast.literal_eval(exclude) if exclude else [])])
  if isinstance(node, ast.List):
    return [re.compile(re.escape(e.value) + "$") for e in node.elts
            if isinstance(e, ast.Constant) and not e.value.startswith(":")], []
  return [], []


def _covers(node, path):
  include, exclude = _matchers(node)
  return any(r.match(path) for r in include) and not any(r.match(path) for r in exclude)


def _files(pattern):
  return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)
                if p.is_file() and "__pycache__" not in p.parts)


def _name(requirement):
  return re.sub(r"[-_.]+", "-", requirement).lower()


def _pyproject_dependencies():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  return [Requirement(r) for r in
          project["dependencies"] + project["optional-dependencies"]["test"]]


def test_build_parses_as_python_and_names_every_module_and_the_package_data():
  build = _parse("BUILD")
  lib = _rule(build, "py_library", "jax_autooverlap")
  modules = _files("jax_autooverlap/**/*.py")
  assert len(modules) > 20
  assert [m for m in modules if not _covers(_kw(lib, "srcs"), m)] == []
  package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
      "package-data"]
  data = [f for pkg, patterns in package_data.items() for p in patterns
          for f in _files(pkg.replace(".", "/") + "/" + p)]
  assert data and [f for f in data if not _covers(_kw(lib, "data"), f)] == []


def test_build_has_a_py_test_for_every_test_file_and_their_helpers_and_data():
  build = _parse("BUILD")
  (comp,) = [n for n in ast.walk(build) if isinstance(n, ast.ListComp)
             and getattr(n.elt.func, "id", None) == "py_test"]
  tests = _files("tests/test_*.py")
  assert "tests/test_build_files.py" in tests
  assert [t for t in tests if not _covers(comp.generators[0].iter, t)] == []
  support = _rule(build, "py_library", "test_support")
  helpers = [f for f in _files("tests/*.py") if f not in tests]
  assert [h for h in helpers if not _covers(_kw(support, "srcs"), h)] == []
  assert _covers(_kw(support, "data"), "tests/mock_libcuda.c")
  data = _kw(_rule(build, "filegroup", "test_data"), "srcs")
  read = ["README.md", "pyproject.toml", "notebooks/explore.ipynb", "bench/ncu_engine.py",
          "BUILD", "MODULE.bazel", "requirements_lock.txt", *_files("tests/fixtures/*"),
          *_files("bench/records/*.json"), *_files("csrc/*")]
  assert [f for f in read if not _covers(data, f)] == []


def test_build_names_every_dependency_and_the_lock_pins_them():
  build = _parse("BUILD")
  named = {_name(c.args[0].value) for c in _calls(build, "requirement")}
  wanted = _pyproject_dependencies()
  assert [str(r) for r in wanted if _name(r.name) not in named] == []
  lock = {}
  for line in (ROOT / "requirements_lock.txt").read_text().splitlines():
    m = re.match(r"([A-Za-z0-9_.\-]+)==([^\s\\;]+)", line)
    if m:
      lock[_name(m.group(1))] = m.group(2)
  # every package BUILD names is pinned, at a version pyproject.toml allows
  assert sorted(named - set(lock)) == []
  for r in wanted:
    pinned = lock[_name(r.name)]
    assert r.specifier.contains(pinned, prereleases=True), (str(r), pinned)


def test_module_bazel_defines_the_pypi_hub_from_the_lock_on_python_312():
  module = _parse("MODULE.bazel")
  assert [ast.literal_eval(_kw(c, "name")) for c in _calls(module, "bazel_dep")] == ["rules_python"]
  (toolchain,) = _calls(module, "toolchain")
  assert ast.literal_eval(_kw(toolchain, "python_version")) == "3.12"
  (parse,) = _calls(module, "parse")
  assert ast.literal_eval(_kw(parse, "hub_name")) == "pypi"
  assert ast.literal_eval(_kw(parse, "requirements_lock")) == "//:requirements_lock.txt"
  assert any(ast.literal_eval(a) == "pypi" for c in _calls(module, "use_repo") for a in c.args[1:])
  build = (ROOT / "BUILD").read_text()
  assert 'load("@pypi//:requirements.bzl", "requirement")' in build


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake")
def test_csrc_cmake_project_configures(tmp_path):
  proc = subprocess.run(["cmake", "-S", str(ROOT / "csrc"), "-B", str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr
