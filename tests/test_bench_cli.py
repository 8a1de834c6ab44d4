"""`python -m jax_autooverlap.bench`: --help lists every command with every option's help, and
each command reaches its own parser (no GPU needed)."""
import argparse

import pytest

from jax_autooverlap.bench import __main__ as bench


def _options(parser):
  """(names, help) of every option and positional a user can give (not -h, not hidden ones)."""
  return [(a.option_strings or [a.dest], a.help) for a in parser._actions
          if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


def test_help_lists_every_command_and_every_option(capsys):
  assert bench.main(["--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("usage:")
  for command in ("{ag,rs} [options]", "{ag,rs} --loopback [options]",
                  "shapes --loopback [options]", "model [options]", "calibrate [options]"):
    assert f"python -m jax_autooverlap.bench {command}" in out
  parsers = bench.parsers()
  assert [p.prog for p in parsers] == ["python -m jax_autooverlap.bench"] * 2 + [
      "python -m jax_autooverlap.bench shapes", "python -m jax_autooverlap.bench model",
      "python -m jax_autooverlap.bench calibrate"]
  for parser in parsers:
    options = _options(parser)
    assert options
    for names, text in options:
      assert text and text.strip(), (parser.prog, names)  # every option says what it does
      assert all(n in out for n in names if n.startswith("--")), (parser.prog, names)
  assert "--loopback" in out and "--smoke" in out and "MxKxN" in out


def test_no_command_prints_the_usage_and_fails(capsys):
  assert bench.main([]) == 2
  err = capsys.readouterr().err
  assert err.startswith("usage:") and "--help" in err


@pytest.mark.parametrize("argv,prog", [
    (["ag", "--help"], "usage: python -m jax_autooverlap.bench [-h] [--shapes"),
    (["rs", "--loopback", "--help"], "usage: python -m jax_autooverlap.bench [-h] --loopback"),
    (["shapes", "--loopback", "--help"], "usage: python -m jax_autooverlap.bench shapes"),
    (["model", "--help"], "usage: python -m jax_autooverlap.bench model"),
    (["calibrate", "--help"], "usage: python -m jax_autooverlap.bench calibrate"),
])
def test_each_command_prints_its_own_help(argv, prog, capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(argv)
  assert e.value.code == 0
  assert capsys.readouterr().out.startswith(prog)
