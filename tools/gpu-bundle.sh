#!/usr/bin/env bash
# Build the bundle that the GPU check carries to a lent machine (docs/backends.md, "Running the
# GPU check on a lent machine"): `dgr build --bundle`, at nice 10.
#
#   tools/gpu-bundle.sh [--backend cuda|cpu|vulkan] [--vulkan] [--cuda-arch 90-real] [--jobs N] [--no-wheels] [OUT_DIR]
#
# OUT_DIR defaults to build/bundle-<backend> (build/bundle-<backend>-vulkan with --vulkan).
# --cuda-arch 90-real (the default): sm_90 machine code for the H100/H200 and no PTX, which
# would double libggml-cuda (the bundle would not travel). The shared build trees are
# build/gpu-bundle-cpu, build/gpu-bundle-cuda and build/gpu-bundle-vulkan (a cuda bundle holds
# the CPU build too: the mixed cpu,cuda route needs a CPU worker; --vulkan adds the Vulkan build
# and the Vulkan loader .debs). It prints the bundle's size by folder and refuses when the bundle
# and the working tree would not travel together (64 MiB, 8 MiB kept free).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BACKEND=cuda; ARCH=90-real; JOBS=2; WHEELS=(); VULKAN=(); OUT_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND="$2"; shift ;;
    --cuda-arch) ARCH="$2"; shift ;;
    --jobs|-j) JOBS="$2"; shift ;;
    --no-wheels) WHEELS=(--no-wheels) ;;
    --vulkan) VULKAN=(--vulkan) ;;
    --wheels) WHEELS=(--wheels) ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "gpu-bundle: unknown option $1" >&2; exit 2 ;;
    *) OUT_DIR="$1" ;;
  esac
  shift
done
SUFFIX=""; [ ${#VULKAN[@]} -gt 0 ] && [ "$BACKEND" != vulkan ] && SUFFIX=-vulkan
OUT_DIR="${OUT_DIR:-build/bundle-$BACKEND$SUFFIX}"
PY="$ROOT/.venv/bin/python"; [ -x "$PY" ] || PY=python3
exec nice -n 10 env PYTHONPATH="$ROOT/cli${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m dgr.main build --bundle "$OUT_DIR" \
  --backend "$BACKEND" --cuda-arch "$ARCH" --jobs "$JOBS" "${WHEELS[@]}" "${VULKAN[@]}"
