#!/usr/bin/env bash
# Triton 3.9 on the GPU machine, whose own Triton is 3.6 (torch 2.11's): the wheel is 286 MB and a
# device call carries 64 MiB, so `pack` slims it to what jax-triton's compile path for NVIDIA needs
# and compresses it to ~58 MB, which travels in one call.
#
#   bash bench/triton39.sh pack       here: .t39/triton39-slim.tar.xz (+ .sha256; .t39/ is ignored)
#   . bench/triton39.sh install       there (sourced): unpack into /tmp/site39 and put it first on
#                                     PYTHONPATH (bench/run_device.sh does this with TRITON39=1)
#
# Slimming (each piece checked by running tests/test_kernel_compile.py on the result): the AMD
# code generator, CUPTI and the profiler library go (the AMD backend's Python stays: backends
# are found through the dist-info's entry points); ptxas becomes a link to ptxas-blackwell (3.9
# compiles sm_90 with ptxas-blackwell, CUDA 13.4; the older ptxas made the AG kernel spill);
# cuobjdump and nvdisasm go; libtriton.so loses its debug info.
VERSION=3.9.0
OUT_DIR=.t39
TARBALL=$OUT_DIR/triton39-slim.tar.xz

pack() {
  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$work/wheel" \
    "triton==$VERSION"
  mkdir -p "$work/tree" "$OUT_DIR"
  (cd "$work/tree" && unzip -q "$work"/wheel/triton-*.whl)
  local t=$work/tree/triton
  rm -rf "$t/backends/amd/lib/libtriton_amd_codegen.so" "$t/backends/nvidia/lib/cupti" \
    "$t/backends/nvidia/lib/cupti-blackwell" "$t/backends/nvidia/bin/cuobjdump" \
    "$t/backends/nvidia/bin/nvdisasm" "$t/backends/nvidia/bin/ptxas" "$t/_C/libproton.so"
  ln -s ptxas-blackwell "$t/backends/nvidia/bin/ptxas"
  strip --strip-debug "$t/_C/libtriton.so"
  echo "packing (xz -9e, a few minutes on two cores)..." >&2
  (cd "$work/tree" && tar cf - triton "triton-$VERSION.dist-info") | xz -T2 -9e > "$TARBALL"
  sha256sum "$TARBALL" | cut -d' ' -f1 > "$TARBALL.sha256"
  ls -l "$TARBALL" >&2
}

install() {
  [[ -f $TARBALL ]] || { echo "triton39: $TARBALL missing (bash bench/triton39.sh pack here, then carry .t39)" >&2; return 1; }
  [[ $(sha256sum "$TARBALL" | cut -d' ' -f1) == $(cat "$TARBALL.sha256") ]] \
    || { echo "triton39: $TARBALL does not match its sha256" >&2; return 1; }
  rm -rf /tmp/site39 && mkdir -p /tmp/site39 && xz -dc "$TARBALL" | tar xf - -C /tmp/site39
  export PYTHONPATH=/tmp/site39${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import triton; assert triton.__version__ == '$VERSION', triton.__version__; print('triton', triton.__version__, 'from', triton.__file__)"
}

case ${1:-} in
  pack) set -euo pipefail; pack ;;
  install) install ;;
  *) echo "usage: bash bench/triton39.sh pack | . bench/triton39.sh install" >&2; return 2 2>/dev/null || exit 2 ;;
esac
