#!/usr/bin/env bash
# Fifteenth round, call 5 (the last ~4 minutes): the capture tests after the fix of the tl AG
# launcher at world 1 (backends/launch.copy_block divided by the 0 push units of a group of 1:
# call 4's traceback; failing on HEAD before this round too, call 3), and the traced Gluon
# tests with the host descriptors.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 90 python3 -m pytest -q -m gpu tests/test_gpu_capture.py -p no:cacheprovider > $X/tests-capture.log 2>&1
timeout 60 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -k traced -p no:cacheprovider > $X/tests-traced.log 2>&1
tar czf $OUT/extra.tgz -C $X .
for f in tests-capture tests-traced; do echo "== $f"; tail -n 3 $X/$f.log | cut -c1-220; done
