"""Configure and build the patched llama.cpp and the dgr-worker into ``build/<backend>/``.

One CMake + Ninja tree per backend (``worker/CMakeLists.txt`` adds the patched llama.cpp as a
static subproject). Only the requested targets are built; ccache is used when present.
Refuses to build from an unverified or dirty pin, or a patched tree that differs from the
committed series.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import __version__, paths
from . import patchstack
from . import pin as pin_mod
from ..errors import DgrError

BACKENDS = ("cpu", "vulkan", "cuda", "hip", "metal")
DEFAULT_TARGETS = ("dgr-worker",)
TEST_TARGETS = ("dgr-tests",)
# Whole-model llama.cpp tools used as yardsticks and helpers (benchmarks, quantize, references,
# llama-gguf-split: writes and merges split GGUF sets).
TOOL_TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-simple",
                "llama-completion", "llama-server", "llama-gguf-split")
BACKEND_CMAKE = {
    "cpu": [],
    "vulkan": ["-DGGML_VULKAN=ON"],
    "cuda": ["-DGGML_CUDA=ON"],
    "hip": ["-DGGML_HIP=ON"],
    "metal": ["-DGGML_METAL=ON"],
}


@dataclass(frozen=True)
class BuildResult:
    backend: str
    build_dir: Path
    bin_dir: Path
    targets: tuple[str, ...]


def check_toolchain(backend: str) -> list[str]:
    """Return the CMake flags for ``backend`` or raise naming what is missing."""
    if backend not in BACKENDS:
        raise DgrError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    missing = [t for t in ("cmake", "ninja") if shutil.which(t) is None]
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        missing.append(f"C++ compiler ({cxx})")
    if missing:
        raise DgrError(f"build tools missing: {', '.join(missing)}",
                       hint="apt-get install build-essential cmake ninja-build")
    flags = list(BACKEND_CMAKE[backend])
    if backend == "cuda":
        flags += _cuda_flags()
    elif backend == "hip":
        if shutil.which("hipcc") is None and not Path("/opt/rocm/bin/hipcc").exists():
            raise DgrError("backend hip needs ROCm (hipcc not found on PATH or in /opt/rocm/bin)")
    elif backend == "metal":
        if platform.system() != "Darwin":
            raise DgrError("backend metal builds only on macOS")
    elif backend == "vulkan":
        flags += _vulkan_flags()
    return _merge_compiler_flags(flags + cpu_isa_flags())


# The pinned ggml's AMX matrix path (an "extra buffer type" chosen over the x86 repack when the
# CPU has AMX and the build is -march=native) crashes in ggml_backend_amx_mul_mat on the first
# decode of any model whose matrices it takes (seen here: n_embd 2048, Q4_K and Q8_0, on a
# Sapphire Rapids vCPU; upstream llama.cpp issue 20824, closed unfixed). SmolLM2's 576-wide rows
# never reach it, larger models always do. The native build keeps every other ISA extension;
# only the AMX ones are switched off (GCC lets an explicit -mno-* win over -march=native).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def _merge_compiler_flags(flags: list[str]) -> list[str]:
    """One -DCMAKE_C_FLAGS / -DCMAKE_CXX_FLAGS each (CMake keeps only the last of a repeated -D)."""
    merged: dict[str, list[str]] = {}
    out: list[str] = []
    for f in flags:
        key = next((k for k in ("-DCMAKE_C_FLAGS=", "-DCMAKE_CXX_FLAGS=") if f.startswith(k)), None)
        if key is None:
            out.append(f)
            continue
        if key not in merged:
            merged[key] = []
            out.append(key)
        merged[key].append(f[len(key):])
    return [f + " ".join(merged[f]) if f in merged else f for f in out]


def cpu_isa_flags() -> list[str]:
    """CMake flags that leave AMX out of a native x86-64 build (see NO_AMX); none elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def cuda_architectures() -> str:
    """CUDAARCHS, else "native" with a GPU present, else the stated default set (compile only)."""
    from .doctor import CUDA_DEFAULT_ARCHS

    return os.environ.get("CUDAARCHS") or ("native" if _has_nvidia_gpu() else CUDA_DEFAULT_ARCHS)


def _cuda_flags() -> list[str]:
    from . import cuda_sdk
    from .doctor import nvcc_path

    nvcc = nvcc_path()
    if nvcc is None:
        raise DgrError("backend cuda needs the CUDA toolkit (nvcc not found on PATH or in /usr/local/cuda/bin)",
                       hint="install the CUDA toolkit; `dgr doctor` lists what is missing")
    flags = [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_architectures()}"]
    if not cuda_sdk.driver_library(nvcc):
        # no libcuda (driver) and no stub to link against: ggml-cuda without its virtual-memory
        # pool links only the runtime, which loads the driver when it runs
        flags.append("-DGGML_CUDA_NO_VMM=ON")
    if shutil.which("ccache"):
        flags.append("-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache")
    return flags + cuda_sdk.cmake_flags(cuda_sdk.ensure(nvcc))


def _has_nvidia_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


def _vulkan_flags() -> list[str]:
    from . import vulkan_sdk

    return vulkan_sdk.cmake_flags(vulkan_sdk.ensure())


def _ensure_sources() -> tuple[pin_mod.Pin, Path, str]:
    pin = pin_mod.load_pin()
    src = pin_mod.located_source()
    pin_mod.verify_tree(src, pin)  # raises on a wrong commit or a dirty pinned tree
    stack = patchstack.default_stack()
    tree = paths.patched_source_dir()
    st = patchstack.apply(stack, src, tree)  # idempotent; raises on local edits
    if st.base != pin.commit:
        raise DgrError(f"patched tree {tree} is based on {st.base}, the pin says {pin.commit}",
                       hint="run `dgr patches apply --force`")
    if st.unexported:
        raise DgrError(f"patched tree {tree} differs from the committed series ({st.unexported[0]})",
                       hint="run `dgr patches export` to keep the change, or `dgr patches apply --force`")
    return pin, tree, stack.series_digest()


def _run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.rstrip())
        tail = tail[-40:]
        # Ninja status lines ("[12/345] Building …") are the progress; compiler chatter is kept
        # for the error message only.
        if line.startswith("[") or "error" in line.lower() or line.startswith(("FAILED", "CMake Error", "-- Configuring done", "-- Build files")):
            sys.stderr.write(line)
    if proc.wait() != 0:
        raise DgrError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}); last lines:\n" + "\n".join(tail[-15:]))


# A relocatable build (`dgr build --bundle`): ggml/llama shared, RPATH $ORIGIN (worker/CMakeLists.txt
# DGR_SHARED_LLAMA); the CPU code for AVX2 (with FMA, F16C, BMI2) instead of -march=native,
# since it runs on another machine whose CPU this one cannot see. NCCL stays out (one GPU).
SHARED_CMAKE = ("-DDGR_SHARED_LLAMA=ON",)
PORTABLE_CPU_CMAKE = ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON",
                      "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF")
PORTABLE_CUDA_CMAKE = ("-DGGML_CUDA_NCCL=OFF",)


def portable_cmake(backend: str) -> tuple[str, ...]:
    """The CMake flags of a build that runs elsewhere (see PORTABLE_CPU_CMAKE)."""
    flags = PORTABLE_CPU_CMAKE if platform.machine().lower() in ("x86_64", "amd64") else ("-DGGML_NATIVE=OFF",)
    return (*flags, *(PORTABLE_CUDA_CMAKE if backend == "cuda" else ()))


def _shared_link_flags(backend: str) -> tuple[str, ...]:
    """A shared CUDA build links its programs against libggml-cuda.so, whose own dependencies
    (cuBLAS, the CUDA runtime) the linker must find to check it: -rpath-link names their folders
    (cuBLAS may come from build/cuda-sdk). Nothing of it is recorded in the programs."""
    if backend != "cuda":
        return ()
    from . import cuda_sdk
    from .doctor import nvcc_path

    nvcc = nvcc_path()
    dirs: list[str] = []
    blas = cuda_sdk.find_cublas(nvcc)
    if blas is not None:
        dirs.append(str(blas.library.parent))
    root = cuda_sdk.toolkit_root(nvcc)
    if root is not None:
        dirs += [str(d) for d in (root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib") if d.is_dir()]
    if not dirs:
        return ()
    link = "-Wl,-rpath-link," + ":".join(dict.fromkeys(dirs))
    return (f"-DCMAKE_EXE_LINKER_FLAGS={link}", f"-DCMAKE_SHARED_LINKER_FLAGS={link}")


def sanitize_build_dir(backend: str = "cpu") -> Path:
    """build/<backend>-asan: the dgr targets built with AddressSanitizer + UBSan (`dgr build --sanitize`)."""
    return paths.build_dir() / f"{backend}-asan"


def build(backend: str = "cpu", *, jobs: int | None = None, clean: bool = False,
          targets: tuple[str, ...] = DEFAULT_TARGETS, extra_cmake: tuple[str, ...] = (),
          sanitize: bool = False, shared: bool = False, build_dir: Path | None = None) -> BuildResult:
    """Build ``targets`` in build/<backend>/; concurrent calls on one tree wait for each other.

    ``sanitize``: build in build/<backend>-asan/ with the dgr targets (worker core, worker, tools,
    CTest programs; not llama.cpp) compiled with -fsanitize=address,undefined.
    ``shared``: ggml/llama as shared libraries next to the programs (RPATH $ORIGIN), the CPU code
    portable (:func:`portable_cmake`), in ``build_dir`` (required: never build/<backend>/, which
    stays the static native tree)."""
    refuse_in_bundle()
    flags = check_toolchain(backend)
    if shared:
        if build_dir is None or sanitize:
            raise DgrError("a shared build needs its own build dir (and no --sanitize)")
        bdir = build_dir
        extra_cmake = (*extra_cmake, *SHARED_CMAKE, *portable_cmake(backend), *_shared_link_flags(backend))
    elif build_dir is not None:
        bdir = build_dir
    else:
        bdir = sanitize_build_dir(backend) if sanitize else paths.backend_build_dir(backend)
    if sanitize:
        extra_cmake = (*extra_cmake, "-DDGR_SANITIZE=ON")
    paths.build_dir().mkdir(parents=True, exist_ok=True)
    with open(paths.build_dir() / f".build-{bdir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(backend, flags, bdir, jobs=jobs, clean=clean, targets=targets, extra_cmake=extra_cmake)


def cmake_build(source: Path, bdir: Path, config: list[str], targets: tuple[str, ...] | list[str], *,
                jobs: int | None = None, stamp: dict | None = None) -> None:
    """Configure ``source`` into ``bdir`` (CMake, Ninja) when the configuration changed or was
    never made, then build ``targets``. ccache is the compiler launcher when installed, with
    CCACHE_BASEDIR=/ so scratch and clean trees reuse cached objects. The stamp
    ``bdir/dgr-config.json`` holds the CMake arguments (with ``stamp``: that dict plus them,
    for what decides the build without being a CMake flag, e.g. the pin and patch digest)."""
    if shutil.which("ccache"):
        config = [*config, "-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache",
                  "-DGGML_CCACHE=OFF"]
    stamp_doc: object = config if stamp is None else {**stamp, "cmake": config}
    stamp_file = bdir / "dgr-config.json"
    previous = json.loads(stamp_file.read_text()) if stamp_file.is_file() else None
    if previous != stamp_doc or not (bdir / "build.ninja").is_file():
        _run(["cmake", "-S", str(source), "-B", str(bdir), *config])
        stamp_file.write_text(json.dumps(stamp_doc, indent=1))
    env = dict(os.environ)
    env.setdefault("CCACHE_BASEDIR", "/")
    _run(["ninja", "-C", str(bdir), f"-j{jobs or os.cpu_count() or 2}", *targets], env=env)


def _build_locked(backend: str, flags: list[str], bdir: Path, *, jobs: int | None, clean: bool,
                  targets: tuple[str, ...], extra_cmake: tuple[str, ...]) -> BuildResult:
    pin, tree, digest = _ensure_sources()
    if clean and bdir.exists():
        shutil.rmtree(bdir)
    bdir.mkdir(parents=True, exist_ok=True)
    config = [
        "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
        f"-DDGR_LLAMA_SOURCE_DIR={tree}",
        f"-DDGR_REPO_ROOT={paths.repo_root()}",
        f"-DDGR_VERSION={__version__}",
        f"-DDGR_PIN_COMMIT={pin.commit}",
        f"-DDGR_PATCH_DIGEST={digest}",
        f"-DDGR_BACKEND={backend}",
        *flags, *extra_cmake,
    ]
    cmake_build(paths.repo_root() / "worker", bdir, config, targets, jobs=jobs)
    # Upstream notices next to the binaries (also done at configure; re-copied in case of clean bin/).
    bin_dir = bdir / "bin"
    for notice in pin.notices:
        if (tree / notice).is_file():
            shutil.copyfile(tree / notice, bin_dir / f"llama.cpp-{notice}")
    write_toolchain_record(backend, bdir, pin.commit, digest)
    return BuildResult(backend, bdir, bin_dir, targets)


TOOLCHAIN_RECORD = "dgr-toolchain.json"


def write_toolchain_record(backend: str, bdir: Path, pin_commit: str, patch_digest: str) -> Path:
    """build/<backend>/dgr-toolchain.json: the toolchain versions this tree was built with
    (compiler, CMake, Ninja, and per backend: glslc, Vulkan headers + their .deb hashes, loader,
    Mesa; nvcc, cuBLAS, CUDA architectures). Evidence copies it."""
    from .doctor import toolchain

    doc = {"backend": backend, "pin_commit": pin_commit, "patch_digest": patch_digest,
           "dgr_version": __version__, "toolchain": toolchain(backend)}
    if backend == "cuda":
        doc["toolchain"]["cuda_architectures"] = cuda_architectures()
    path = bdir / TOOLCHAIN_RECORD
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def toolchain_record(backend: str) -> dict | None:
    """The record written by the last build of ``backend`` (None when not built)."""
    try:
        return json.loads((paths.backend_build_dir(backend) / TOOLCHAIN_RECORD).read_text())
    except (OSError, ValueError):
        return None


def worker_binary_path(backend: str = "cpu") -> Path:
    """Where the dgr-worker for ``backend`` is: ``$DGR_WORKER_BIN`` when set (one binary for
    every backend: tests, a prebuilt worker), else ``<build dir>/<backend>/bin/dgr-worker`` (the
    build dir honours ``$DGR_BUILD_DIR``). The one locator: supervisor and route code call it."""
    env = os.environ.get("DGR_WORKER_BIN")
    return Path(env) if env else paths.backend_build_dir(backend) / "bin" / "dgr-worker"


def worker_binary(backend: str = "cpu") -> Path:
    exe = worker_binary_path(backend)
    if not exe.is_file():
        raise DgrError(f"{exe} not built", hint=f"run `dgr build --backend {backend}`")
    return exe


BUNDLE_MANIFEST = "dgr-bundle.json"


def bundle_manifest() -> dict | None:
    """The manifest of a prebuilt bundle (`dgr build --bundle`) when the build dir is one
    (DGR_BUILD_DIR=<bundle>: its <backend>/bin hold the programs), else None."""
    try:
        return json.loads((paths.build_dir() / BUNDLE_MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def refuse_in_bundle() -> None:
    """A bundle is prebuilt and travels without sources: nothing is (re)built inside it."""
    if bundle_manifest() is not None:
        raise DgrError(f"{paths.build_dir()} is a prebuilt bundle ({BUNDLE_MANIFEST}): nothing is built here",
                       hint="build on the machine that made the bundle (`dgr build --bundle`), then carry it again")


def tool_binary(name: str, backend: str = "cpu", *, build_missing: bool = True) -> Path:
    """A built program of build/<backend>/bin; with ``build_missing`` it is (re)built when
    missing or out of date (a no-op Ninja run otherwise; never inside a prebuilt bundle)."""
    exe = paths.backend_build_dir(backend) / "bin" / name
    if build_missing and bundle_manifest() is not None:
        build_missing = False
    if build_missing:
        build(backend, targets=(name,))
    elif not exe.is_file():
        raise DgrError(f"{exe} not built", hint=f"run `dgr build --backend {backend} --target {name}`")
    return exe


# --- llama.cpp's own RPC split (a yardstick for routes) --------------------------------------
# GGML_RPC stays off in build/<backend>/ (the worker tree); the RPC tools are configured straight
# from the patched llama.cpp tree into their own build/<backend>-rpc/ so that tree is never touched.
RPC_SERVER = "ggml-rpc-server"   # the pinned CMake target/binary name (older upstreams: rpc-server)
RPC_TARGETS = (RPC_SERVER, "llama-bench", "llama-batched-bench")
_RPC_ALIASES = {"rpc-server": RPC_SERVER}
_RPC_CMAKE = (
    "-DGGML_RPC=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_IS_DEV=OFF",
)


def rpc_build_dir(backend: str = "cpu") -> Path:
    return paths.build_dir() / f"{backend}-rpc"


def build_rpc_tools(backend: str = "cpu", jobs: int | None = None, *, clean: bool = False) -> Path:
    """Build llama.cpp's RPC server and an RPC-enabled llama-bench in build/<backend>-rpc/ and
    return its bin dir; concurrent calls on that tree wait for each other."""
    flags = check_toolchain(backend)
    paths.build_dir().mkdir(parents=True, exist_ok=True)
    with open(paths.build_dir() / f".build-{backend}-rpc.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_rpc_locked(backend, flags, jobs=jobs, clean=clean)


def _build_rpc_locked(backend: str, flags: list[str], *, jobs: int | None, clean: bool) -> Path:
    pin, tree, digest = _ensure_sources()
    bdir = rpc_build_dir(backend)
    if clean and bdir.exists():
        shutil.rmtree(bdir)
    bdir.mkdir(parents=True, exist_ok=True)
    config = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", *_RPC_CMAKE, *flags]
    print(f"llama.cpp RPC tools ({backend}) in {bdir}", file=sys.stderr, flush=True)
    # the pin and patch digest are in the stamp (not CMake flags): a new series reconfigures
    cmake_build(tree, bdir, config, RPC_TARGETS, jobs=jobs,
                stamp={"source": str(tree), "pin": pin.commit, "patches": digest})
    bin_dir = bdir / "bin"
    for alias, name in _RPC_ALIASES.items():   # `rpc-server`, the name the docs and older pins use
        link = bin_dir / alias
        if alias != name and not link.exists():
            link.unlink(missing_ok=True)        # a dangling link
            link.symlink_to(name)
    for notice in pin.notices:
        if (tree / notice).is_file():
            shutil.copyfile(tree / notice, bin_dir / f"llama.cpp-{notice}")
    return bin_dir


def rpc_tool_binary(name: str, backend: str = "cpu", *, build_missing: bool = True) -> Path:
    """``rpc-server`` (alias of the pinned ``ggml-rpc-server``) or ``llama-bench`` of
    build/<backend>-rpc/bin; with ``build_missing`` the RPC tree is (re)built first (a no-op
    Ninja run when up to date)."""
    real = _RPC_ALIASES.get(name, name)
    if real not in RPC_TARGETS:
        raise DgrError(f"unknown RPC tool {name!r}; choose one of rpc-server, {', '.join(RPC_TARGETS)}")
    exe = rpc_build_dir(backend) / "bin" / real
    if build_missing:
        build_rpc_tools(backend)
    elif not exe.is_file():
        raise DgrError(f"{exe} not built (llama.cpp RPC tools, GGML_RPC=ON)",
                       hint=f"python -c 'from dgr.upstream.build import build_rpc_tools; build_rpc_tools(\"{backend}\")'")
    return exe
