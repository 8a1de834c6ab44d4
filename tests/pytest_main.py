"""Entry point for Bazel py_test targets: run pytest on the files named on the command line."""
import sys

import pytest

if __name__ == "__main__":
  sys.exit(pytest.main(["-q", *sys.argv[1:]]))
