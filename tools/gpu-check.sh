#!/usr/bin/env bash
# The GPU check for a lent machine (docs/backends.md, "Running the GPU check on a lent machine").
#
#   bash tools/gpu-check.sh                  # on the GPU machine, with build/bundle-cuda carried
#   bash tools/gpu-check.sh --dry-run-cpu    # here: the same steps, CPU bundle, tiny models (< 3 min)
#   bash tools/gpu-check.sh --bundle build/bundle-cuda-vulkan   # and the Vulkan worker on the driver
#
# Options: --bundle DIR (default build/bundle-cuda-vulkan where it exists, else build/bundle-cuda;
# dry run build/bundle-cpu), --deadline S (the
# whole run, default 450; dry run 240), --no-large (skip the 8B-shaped model), --no-vulkan (skip
# the Vulkan steps of a bundle that holds a Vulkan build; in the dry run they run on llvmpipe).
# Environment: OUT (results: gpu-check.json, gpu-check.log, nvidia-smi-q.txt; default
# build/gpu-check-out), GPU_CHECK_WORK (models, step files; default /tmp/dgr-gpu-check),
# PYTHON (default python3), BACKEND=cpu (same as --dry-run-cpu), GPU_CHECK_LOADER=carried (unpack
# the bundle's Vulkan loader .debs even where the machine has libvulkan.so.1: tries that path here).
#
# Every step runs under `timeout`, inside what is left of the deadline; a step that fails is
# recorded and the next one runs; steps that no longer fit are recorded as skipped. One JSON
# document (schema dgr.gpu-check/1) is written at the end, whatever happened before.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BACKEND="${BACKEND:-cuda}"
BUNDLE=""
DEADLINE=""
LARGE=1
VULKAN=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run-cpu) BACKEND=cpu ;;
    --bundle) BUNDLE="$2"; shift ;;
    --deadline) DEADLINE="$2"; shift ;;
    --no-large) LARGE=0 ;;
    --no-vulkan) VULKAN=0 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
if [ "$BACKEND" = cpu ]; then
  BUNDLE="${BUNDLE:-build/bundle-cpu}"; DEADLINE="${DEADLINE:-240}"
else
  if [ -z "$BUNDLE" ] && [ -f build/bundle-cuda-vulkan/dgr-bundle.json ]; then BUNDLE=build/bundle-cuda-vulkan; fi
  BUNDLE="${BUNDLE:-build/bundle-cuda}"; DEADLINE="${DEADLINE:-450}"
fi
BUNDLE="$(cd "$BUNDLE" 2>/dev/null && pwd || echo "$ROOT/$BUNDLE")"
OUT="${OUT:-$ROOT/build/gpu-check-out}"
WORK="${GPU_CHECK_WORK:-/tmp/dgr-gpu-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT" "$WORK"
STEPS="$WORK/steps"; MODELS="$WORK/models"
rm -rf "$STEPS"; mkdir -p "$STEPS" "$MODELS"
LOG="$OUT/gpu-check.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

T0=$(date +%s)
STARTED="$(date +%Y-%m-%dT%H:%M:%S%z)"
RESERVE=15      # seconds kept for the report
log() { echo "[gpu-check +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) - RESERVE )); }

log "backend $BACKEND, bundle $BUNDLE, deadline ${DEADLINE}s, out $OUT, work $WORK"

# ---- environment: the bundle, unpacked by the preflight step, is the build dir; carried wheels;
# the CUDA libraries of the machine ----
export DGR_BUILD_DIR="$WORK/bundle"
export DGR_CERT_DIR="$WORK/certified"          # never the machine's own certifications
export DGR_MODEL_DIR="$WORK/models"
export GIT_PYTHON_REFRESH=quiet                # GitPython without a git executable
export PYTHONUNBUFFERED=1
export TMPDIR="${TMPDIR:-/tmp}"
if [ "$BACKEND" = cpu ]; then export DGR_GPU_CHECK_DRY_RUN=1; fi   # targets measured, not judged (Vulkan's too)
SITE="$WORK/site"
if compgen -G "$BUNDLE/wheels/*.whl" >/dev/null; then
  rm -rf "$SITE"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/wheels/*.whl; then
    log "pip install of the carried wheels failed"
  fi
  export PYTHONPATH="$SITE:$ROOT/cli${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT/cli${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$BACKEND" = cuda ]; then
  # libcuda (driver), libcudart, libcublas, libcublasLt: the machine's, never carried
  libdirs=""
  nvroot="$("$PY" -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)"
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           ${nvroot:+$nvroot/nvidia/cu13/lib $nvroot/nvidia/cublas/lib $nvroot/nvidia/cuda_runtime/lib}; do
    if compgen -G "$d/libcublas.so*" >/dev/null || compgen -G "$d/libcudart.so*" >/dev/null || compgen -G "$d/libcuda.so*" >/dev/null; then
      libdirs="${libdirs:+$libdirs:}$d"
    fi
  done
  export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  if command -v nvidia-smi >/dev/null; then timeout 60 nvidia-smi -q >"$OUT/nvidia-smi-q.txt" 2>&1 || true; fi
  THREADS=$(( $(nproc) < 8 ? $(nproc) : 8 ))
  SMALL_SYNTH=(--preset llama-3.2-1b)                 # 16 layers, Q4_K_M, 766 MiB
  LARGE_SYNTH=(--preset llama-3.1-8b)                 # 32 layers, Q4_K_M, 4.6 GiB
  SMALL_SPLITS=(0:8,8:16 0:5,5:11,11:16); LARGE_SPLIT=0:16,16:32
  BENCH=(--levels 1,8,32 --n-prompt 32 --n-gen 128 --repeats 3)
  BENCH_LARGE=(--levels 1,8,32 --n-prompt 32 --n-gen 128 --repeats 2)
  PP=(--n-prompt 512 --repeats 5)
  ROUTE=(--sessions 8 --n-prompt 32 --n-gen 64 --repeats 2)
  TOKENS=32
  MIXED=cpu,cuda
  LARGE_NEEDS=200                                     # seconds left that the 8B steps need
else
  THREADS=2
  SMALL_SYNTH=(--layers 4 --dtype q8_0)               # tiny: n_embd 64, vocabulary 469
  LARGE_SYNTH=(--layers 8 --n-embd 128 --dtype q8_0 --seed 1)
  SMALL_SPLITS=(0:2,2:4 0:1,1:3,3:4); LARGE_SPLIT=0:4,4:8
  BENCH=(--levels 1,8,32 --n-prompt 16 --n-gen 16 --repeats 1)
  BENCH_LARGE=(--levels 1,8,32 --n-prompt 16 --n-gen 16 --repeats 1)
  PP=(--n-prompt 128 --repeats 2)                     # the tiny models' context is 256
  ROUTE=(--sessions 8 --n-prompt 16 --n-gen 16 --repeats 1)
  TOKENS=16
  MIXED=cpu,cpu
  LARGE_NEEDS=60
fi

# ---- the Vulkan worker (a bundle with a Vulkan build): the machine's Vulkan loader, else the
# carried .debs unpacked into the work folder (never over /); NVIDIA's Vulkan driver (ICD) ----
VK=""           # empty: the Vulkan steps run; else why they are skipped
VK_LOADER=""
bundle_backends=$("$PY" -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1])).get("backends", [])))' \
  "$BUNDLE/dgr-bundle.json" 2>/dev/null || true)
if [[ " $bundle_backends " != *" vulkan "* ]]; then
  VK="not carried: the bundle holds no Vulkan build (dgr build --bundle OUT --backend cuda --vulkan; docs/backends.md)"
elif [ "$VULKAN" = 0 ]; then
  VK="not run: --no-vulkan"
else
  ldcache() { { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true; } | grep -F "$1" | head -1; }
  if [ "${GPU_CHECK_LOADER:-}" != carried ] && [ -n "$(ldcache libvulkan.so.1)" ]; then
    VK_LOADER="the machine's: $(ldcache libvulkan.so.1 | sed 's/.*=> //')"
  elif compgen -G "$BUNDLE/debs/*.deb" >/dev/null; then
    GL="$WORK/gl"; rm -rf "$GL"; mkdir -p "$GL"
    for f in "$BUNDLE"/debs/*.deb; do
      if command -v dpkg >/dev/null; then dpkg -x "$f" "$GL" || log "dpkg -x $f failed"
      else "$PY" -c 'import sys; from pathlib import Path; from dgr.upstream.bundle import unpack_deb
unpack_deb(Path(sys.argv[1]), Path(sys.argv[2]))' "$f" "$GL" || log "unpacking $f failed"; fi
    done
    export LD_LIBRARY_PATH="$GL/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    VK_LOADER="carried: $(cd "$BUNDLE/debs" && echo *.deb) unpacked into $GL"
  else
    VK_LOADER="none: no libvulkan.so.1 here and no .debs in the bundle"
  fi
  ICD=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json          # the driver's, where the loader may not look
  EGL_VENDOR=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$ICD" ]; then
    export VK_DRIVER_FILES="$ICD"; export VK_ICD_FILENAMES="${VK_ICD_FILENAMES:-$ICD}"   # the latter: loaders < 1.3.207
  fi
  if [ -z "${__EGL_VENDOR_LIBRARY_FILENAMES:-}" ] && [ -f "$EGL_VENDOR" ]; then
    export __EGL_VENDOR_LIBRARY_FILENAMES="$EGL_VENDOR"
  fi
  log "Vulkan loader: $VK_LOADER; VK_DRIVER_FILES=${VK_DRIVER_FILES:-}"
fi
if [ "$BACKEND" = cpu ]; then
  VK_CLASS=vulkan:llvmpipe; VK_BENCH_NEEDS=$(( LARGE_NEEDS + 40 ))   # Mesa's Vulkan on the CPU here
else
  VK_CLASS=vulkan:nvidia; VK_BENCH_NEEDS=$(( LARGE_NEEDS + 100 ))
fi

ORDER=""
ABORT=""
# step ID LIMIT TITLE -- python-step-args...: runs `python -m dgr.bench.gpu_check ARGS` under
# timeout; records a skip when it no longer fits, an error when it wrote no result. SB=vulkan
# step ...: the step's programs are the bundle's Vulkan build.
step() {
  local id="$1" limit="$2" title="$3"; shift 4
  local BACKEND="${SB:-$BACKEND}"
  ORDER="${ORDER:+$ORDER,}$id"
  local out="$STEPS/$id.json" rem; rem=$(left)
  if [ -n "$ABORT" ]; then
    "$PY" -m dgr.bench.gpu_check skip --step-id "$id" --title "$title" --backend "$BACKEND" --out "$out" --reason "$ABORT" || true
    return 0
  fi
  if [ "$rem" -lt 20 ]; then
    log "skip $id: ${rem}s left of the deadline"
    "$PY" -m dgr.bench.gpu_check skip --step-id "$id" --title "$title" --backend "$BACKEND" --out "$out" \
      --reason "not started: ${rem}s left of the ${DEADLINE}s deadline" || true
    return 0
  fi
  local t=$(( limit < rem ? limit : rem ))
  log "step $id ($title), up to ${t}s"
  local rc=0
  bounded "$t" "$PY" -m dgr.bench.gpu_check "$1" --step-id "$id" --title "$title" --backend "$BACKEND" \
    --bundle "$BUNDLE" --out "$out" "${@:2}" || rc=$?
  if [ ! -s "$out" ]; then
    "$PY" -m dgr.bench.gpu_check fallback --step-id "$id" --title "$title" --backend "$BACKEND" --out "$out" \
      --exit "$rc" --limit "$t" || true
  fi
}
# bounded SECONDS CMD...: CMD in a process group of its own (setsid), stopped at SECONDS (TERM, then
# KILL 10 s later; exit 124); afterwards whatever is left of that group (workers, llama tools) is
# killed, by the group's id, so that nothing of a stopped step holds the GPU.
bounded() {
  local t="$1"; shift
  local flag; flag="$(mktemp)"; rm -f "$flag"
  setsid "$@" &
  local pid=$!
  ( sp=""; trap '[ -n "$sp" ] && kill "$sp"; exit 0' TERM
    sleep "$t" & sp=$!; wait "$sp"
    touch "$flag"; kill -TERM -- "-$pid"
    sleep 10 & sp=$!; wait "$sp"
    kill -KILL -- "-$pid" ) </dev/null >/dev/null 2>&1 &
  local killer=$!
  local rc=0
  wait "$pid" || rc=$?
  kill "$killer" 2>/dev/null || true
  wait "$killer" 2>/dev/null || true
  kill -KILL -- "-$pid" 2>/dev/null || true
  if [ -e "$flag" ]; then rm -f "$flag"; rc=124; fi
  return "$rc"
}
synth() {  # synth ID LIMIT PATH ARGS...: a model written with `dgr gguf synth`
  local id="$1" limit="$2" path="$3"; shift 3
  step "$id" "$limit" "dgr gguf synth $*" -- cli --expect ok -- gguf synth -o "$path" "$@"
  if [ ! -s "$path" ]; then return 1; fi
}

step preflight 120 "unpack the bundle; its programs load and run here" -- preflight
if grep -q '"status": "fail"' "$STEPS/preflight.json" 2>/dev/null || [ ! -s "$STEPS/preflight.json" ]; then
  ABORT="not run: the preflight failed (see its result)"
fi
step device 60 "GPU, host and bundle" -- device
if [ "$BACKEND" = cuda ] && grep -q '"status": "fail"' "$STEPS/device.json" 2>/dev/null; then
  ABORT="${ABORT:-not run: nvidia-smi lists no GPU (see the device step)}"
fi

SMALL="$MODELS/small.gguf"; LARGE_M="$MODELS/large.gguf"
if synth synth-small 180 "$SMALL" "${SMALL_SYNTH[@]}"; then :; else ABORT="${ABORT:-not run: no model (synth-small failed)}"; fi
S2="${SMALL_SPLITS[0]}"; S3="${SMALL_SPLITS[1]}"
PROMPT="The quick brown fox jumps over the lazy dog"
step parity-2 150 "2-range greedy parity vs the whole model ($BACKEND)" -- cli --expect parity -- \
  route run --model "$SMALL" --split "$S2" --backend "$BACKEND" --parity --raw --prompt "$PROMPT" \
  --max-tokens "$TOKENS" --threads "$THREADS" --json
step parity-3 150 "3-range greedy parity vs the whole model ($BACKEND)" -- cli --expect parity -- \
  route run --model "$SMALL" --split "$S3" --backend "$BACKEND" --parity --raw --prompt "$PROMPT" \
  --max-tokens "$TOKENS" --threads "$THREADS" --json
step drift-mixed 180 "mixed route $MIXED: drift vs the CPU whole model" -- cli --expect drift -- \
  route drift --backend "$MIXED" --reference cpu --model "$SMALL" --split "$S2" --raw --prompt "$PROMPT" \
  --tokens "$TOKENS" --threads "$THREADS" --json
step worker-bench 240 "dgr-worker vs llama-batched-bench, B=1,8,32" -- worker-bench --model "$SMALL" \
  --threads "$THREADS" "${BENCH[@]}"
step prefill 120 "dgr-worker prefill vs llama-bench pp" -- prefill --model "$SMALL" --threads "$THREADS" "${PP[@]}"
step route-b8 180 "2-process route vs whole model at B=8; VRAM per shard" -- route --model "$SMALL" --split "$S2" \
  --threads "$THREADS" "${ROUTE[@]}"
step certify 150 "dgr certify --backend $BACKEND: this device's own certification" -- cli --expect certified -- \
  certify --backend "$BACKEND" --model "$SMALL" --tokens 16 --threads "$THREADS" --json

# ---- the Vulkan worker on the GPU's driver (a bundle with a Vulkan build; llvmpipe in the dry run) ----
if [ -z "$VK" ] && [ -n "$ABORT" ]; then VK="$ABORT"; fi
if [ -z "$VK" ] && "$PY" -c 'import json, sys; sys.exit("vulkan" not in json.load(open(sys.argv[1]))["result"]["unusable_backends"])' \
     "$STEPS/preflight.json" 2>/dev/null; then
  VK="not run: the Vulkan programs do not load here (loader: $VK_LOADER; see the preflight)"
fi
if [ -n "$VK" ]; then
  step vulkan 10 "the Vulkan worker on the NVIDIA driver" -- skip --reason "$VK"
else
  SB=vulkan step vulkan-device 120 "the Vulkan worker's device ($VK_CLASS expected)" -- vulkan-device \
    --model "$SMALL" --threads "$THREADS" --expect-class "$VK_CLASS" --loader "$VK_LOADER"
  if ! grep -q '"status": "pass"' "$STEPS/vulkan-device.json" 2>/dev/null; then
    VK="not run: the Vulkan worker does not run on $VK_CLASS (see vulkan-device)"
  fi
  if [ -z "$VK" ]; then
    SB=vulkan step parity-2-vulkan 150 "2-range greedy parity vs the whole model (vulkan)" -- cli --expect parity -- \
      route run --model "$SMALL" --split "$S2" --backend vulkan --parity --raw --prompt "$PROMPT" \
      --max-tokens "$TOKENS" --threads "$THREADS" --json
    SB=vulkan step certify-vulkan 180 "dgr certify --backend vulkan: this device's own certification" -- \
      cli --expect certified -- certify --backend vulkan --model "$SMALL" --tokens 16 --threads "$THREADS" --json
  else
    for id in parity-2-vulkan certify-vulkan; do step "$id" 10 "the Vulkan worker" -- skip --reason "$VK"; done
  fi
  if [ -z "$VK" ] && [ "$(left)" -gt "$VK_BENCH_NEEDS" ]; then
    SB=vulkan step worker-bench-vulkan 180 "Vulkan: dgr-worker vs llama-batched-bench, B=1,8" -- worker-bench \
      --model "$SMALL" --threads "$THREADS" "${BENCH[@]}" --levels 1,8
  else
    step worker-bench-vulkan 10 "Vulkan: dgr-worker vs llama-batched-bench" -- skip \
      --reason "${VK:-not run: $(left)s left of the ${DEADLINE}s deadline (needs $VK_BENCH_NEEDS: the large-model steps come first)}"
  fi
fi

if [ "$LARGE" = 1 ] && [ -z "$ABORT" ] && [ "$(left)" -gt "$LARGE_NEEDS" ]; then
  if synth synth-large 180 "$LARGE_M" "${LARGE_SYNTH[@]}"; then
    step worker-bench-large 240 "large model: dgr-worker vs llama-batched-bench, B=1,8,32" -- worker-bench \
      --model "$LARGE_M" --threads "$THREADS" "${BENCH_LARGE[@]}"
    step prefill-large 120 "large model: dgr-worker prefill vs llama-bench pp" -- prefill --model "$LARGE_M" \
      --threads "$THREADS" "${PP[@]}"
    step route-b8-large 180 "large model: 2-process route vs whole at B=8; VRAM per shard" -- route \
      --model "$LARGE_M" --split "$LARGE_SPLIT" --threads "$THREADS" "${ROUTE[@]}"
  fi
else
  why="not run: $([ "$LARGE" = 1 ] && echo "$(left)s left of the ${DEADLINE}s deadline (needs $LARGE_NEEDS)" || echo "--no-large")"
  [ -n "$ABORT" ] && why="$ABORT"
  for id in synth-large worker-bench-large prefill-large route-b8-large; do
    step "$id" 10 "large model" -- skip --reason "$why"
  done
fi
rm -f "$LARGE_M"

log "report"
"$PY" -m dgr.bench.gpu_check report --steps "$STEPS" --out "$OUT/gpu-check.json" --backend "$BACKEND" \
  --order "$ORDER" --started "$STARTED" --started-epoch "$T0" --bundle "$BUNDLE"
log "done: $OUT/gpu-check.json"
