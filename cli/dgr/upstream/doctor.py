"""`dgr doctor`: for each compute backend, what this machine has, what is missing and the
exact command that installs it; and the toolchain versions a build records.

Everything here only looks (``shutil.which``, ``dpkg-query``, ``--version`` of tools, header
files); nothing is installed or built. ``dgr build --backend B`` does the obtaining.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

BACKENDS = ("cpu", "vulkan", "cuda", "hip", "metal")
BUILD_PACKAGES = ("build-essential", "cmake", "ninja-build", "ccache", "pkg-config",
                  "libgrpc++-dev", "libprotobuf-dev", "protobuf-compiler", "protobuf-compiler-grpc")
# CUDA: the architectures `dgr build --backend cuda` compiles for when there is no GPU to ask
# (a GPU present: "native"); CUDAARCHS or --cuda-arch override.
CUDA_DEFAULT_ARCHS = "80;89;90"


@dataclass
class Item:
    name: str
    present: bool
    detail: str = ""          # version or path when present, what is wrong when not


@dataclass
class BackendReport:
    backend: str
    items: list[Item] = field(default_factory=list)
    install: list[str] = field(default_factory=list)   # commands that install what is missing
    notes: list[str] = field(default_factory=list)
    built: str = ""                                     # build/<backend>/bin/dgr-worker when built

    @property
    def ready(self) -> bool:
        return all(i.present for i in self.items)

    def to_json(self) -> dict:
        d = asdict(self)
        d["ready"] = self.ready
        return d


def _first_line(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = (r.stdout or r.stderr).strip()
    return text.splitlines()[0].strip() if text else ""


def tool_version(name: str, args: tuple[str, ...] = ("--version",)) -> str:
    """First line of ``name --version`` (or ``args``), '' when the tool is missing."""
    exe = shutil.which(name)
    return _first_line([exe, *args]) if exe else ""


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    p = Path("/usr/local/cuda/bin/nvcc")
    return str(p) if p.exists() else None


def nvcc_version(nvcc: str | None = None) -> str:
    nvcc = nvcc or nvcc_path()
    if not nvcc:
        return ""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    m = re.search(r"release ([\d.]+), (V[\d.]+)", out)
    return f"{m.group(1)} ({m.group(2)})" if m else out.strip().splitlines()[-1:][0] if out.strip() else ""


def _apt_cmd(pkgs) -> str:
    from .vulkan_sdk import apt_install_command

    return apt_install_command(list(pkgs))


def _deb_items(pkgs) -> list[Item]:
    from .vulkan_sdk import deb_installed

    out = []
    for p in pkgs:
        v = deb_installed(p)
        out.append(Item(f"apt:{p}", v is not None, v or "not installed"))
    return out


def _common(rep: BackendReport) -> None:
    for name in ("cmake", "ninja"):
        v = tool_version(name)
        rep.items.append(Item(name, bool(v), v or "not on PATH"))
    cxx = os.environ.get("CXX") or "c++"
    v = tool_version(cxx)
    rep.items.append(Item(f"C++ compiler ({cxx})", bool(v), v or "not on PATH"))
    for name in ("protoc", "grpc_cpp_plugin"):
        exe = shutil.which(name)
        rep.items.append(Item(name, exe is not None, exe or "not on PATH"))
    pc = shutil.which("pkg-config")
    ok = pc is not None and subprocess.run([pc, "--exists", "grpc++", "protobuf"], capture_output=True).returncode == 0
    rep.items.append(Item("gRPC C++ + Protobuf (pkg-config grpc++ protobuf)", ok,
                          _first_line([pc, "--modversion", "grpc++"]) if ok else "not found"))
    if not all(i.present for i in rep.items):
        rep.install.append(_apt_cmd(BUILD_PACKAGES))


def _built(rep: BackendReport, devices: bool = False) -> None:
    from .. import paths

    try:
        exe = paths.backend_build_dir(rep.backend) / "bin" / "dgr-worker"
    except Exception:  # noqa: BLE001 - outside a checkout: nothing built
        return
    if exe.is_file():
        rep.built = str(exe)
        if devices:
            found = worker_devices(exe, rep.backend)
            rep.notes.append("devices the built worker sees: " + ("; ".join(found) if found else "none"))


def check_cpu() -> BackendReport:
    rep = BackendReport("cpu")
    _common(rep)
    _built(rep)
    return rep


def check_vulkan() -> BackendReport:
    from . import vulkan_sdk as vk

    rep = BackendReport("vulkan")
    _common(rep)
    if shutil.which("dpkg-query"):
        debs = _deb_items(vk.SYSTEM_PACKAGES)
        rep.items += debs
        missing = [i.name[4:] for i in debs if not i.present]
        if missing:
            rep.install.append(_apt_cmd(missing))
    v = tool_version("glslc")
    rep.items.append(Item("glslc", bool(v), v or "not on PATH"))
    lib = vk.loader_library()
    rep.items.append(Item("Vulkan loader (libvulkan.so.1)", lib is not None, str(lib) if lib else "not found"))
    sdk = vk.find_sdk()
    if sdk is not None:
        rep.items.append(Item(f"Vulkan headers >= 1.3.{vk.MIN_HEADER_VERSION}", True,
                              f"VK_HEADER_VERSION {sdk.header_version} ({sdk.source}: {sdk.include_dir})"))
    else:
        sys_v = vk.header_version(Path("/usr/include"))
        rep.items.append(Item(f"Vulkan headers >= 1.3.{vk.MIN_HEADER_VERSION}", False,
                              f"system headers: {'none' if sys_v is None else f'VK_HEADER_VERSION {sys_v}'}"))
        suite = vk.newer_suite()
        if suite:
            rep.install.append(f"dgr build --backend vulkan   (fetches libvulkan-dev + spirv-headers from "
                               f"Debian {suite} into build/vulkan-sdk, hash-checked; installs nothing)")
        else:
            rep.install.append("unpack libvulkan-dev + spirv-headers >= 1.3.309 (dpkg -x) into a prefix and "
                               "export DGR_VULKAN_PREFIX=<prefix>")
    icds = sorted(p.name for p in Path("/usr/share/vulkan/icd.d").glob("*.json")) if Path("/usr/share/vulkan/icd.d").is_dir() else []
    rep.notes.append("Vulkan drivers (ICDs): " + (", ".join(icds) if icds else "none") +
                     "; Mesa's lvp_icd is llvmpipe (Vulkan on the CPU)")
    _built(rep, devices=True)
    return rep


def check_cuda() -> BackendReport:
    from . import cuda_sdk

    rep = BackendReport("cuda")
    _common(rep)
    nvcc = nvcc_path()
    rep.items.append(Item("nvcc", nvcc is not None, f"{nvcc} {nvcc_version(nvcc)}" if nvcc else "not found"))
    if nvcc is None:
        rep.install.append("install the CUDA toolkit (nvcc) so that `nvcc` is on PATH or in /usr/local/cuda/bin")
    blas = cuda_sdk.find_cublas(nvcc)
    rep.items.append(Item("cuBLAS headers + library", blas is not None,
                          f"{blas.source}: {blas.root}" if blas else "not in the toolkit"))
    if blas is None and nvcc:
        rep.install.append("dgr build --backend cuda   (downloads the nvidia-cublas wheel matching nvcc with pip "
                           "into build/cuda-sdk, hash-checked; installs nothing)")
    gpu = _first_line(["nvidia-smi", "-L"]) if shutil.which("nvidia-smi") else ""
    rep.notes.append(f"GPU: {gpu}" if gpu else
                     f"no NVIDIA GPU here: the build compiles for CUDA architectures {CUDA_DEFAULT_ARCHS} "
                     "(compile only; running needs a GPU)")
    _built(rep)
    return rep


def check_hip() -> BackendReport:
    rep = BackendReport("hip")
    _common(rep)
    hipcc = shutil.which("hipcc") or ("/opt/rocm/bin/hipcc" if Path("/opt/rocm/bin/hipcc").exists() else None)
    rep.items.append(Item("hipcc (ROCm)", hipcc is not None, hipcc or "not found"))
    if hipcc is None:
        rep.install.append("install ROCm (hipcc in /opt/rocm/bin); not packaged for this project's machines")
    _built(rep)
    return rep


def check_metal() -> BackendReport:
    rep = BackendReport("metal")
    mac = platform.system() == "Darwin"
    rep.items.append(Item("macOS", mac, platform.system()))
    if not mac:
        rep.notes.append("Metal builds only on macOS")
    else:
        _common(rep)
    _built(rep)
    return rep


CHECKS = {"cpu": check_cpu, "vulkan": check_vulkan, "cuda": check_cuda, "hip": check_hip, "metal": check_metal}


def check(backend: str) -> BackendReport:
    from ..errors import DgrError

    if backend not in CHECKS:
        raise DgrError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return CHECKS[backend]()


def toolchain(backend: str) -> dict[str, str]:
    """The toolchain versions a build of ``backend`` records (build/<backend>/dgr-toolchain.json,
    evidence): compiler, CMake, Ninja and the backend's own (glslc, headers, loader, Mesa; nvcc)."""
    out = {"cmake": tool_version("cmake"), "ninja": tool_version("ninja"),
           "cxx": tool_version(os.environ.get("CXX") or "c++"), "platform": platform.platform()}
    if backend == "vulkan":
        from . import vulkan_sdk as vk

        out["glslc"] = tool_version("glslc")
        for p in vk.SYSTEM_PACKAGES:
            out[f"deb:{p}"] = vk.deb_installed(p) or ""
        sdk = vk.find_sdk()
        if sdk is not None:
            out["vulkan_headers"] = f"1.x.{sdk.header_version} ({sdk.source})"
            for pkg in sdk.packages:
                out[f"deb:{pkg['name']}"] = f"{pkg['version']} ({pkg['suite']}, sha256 {pkg['sha256']})"
    elif backend == "cuda":
        out["nvcc"] = nvcc_version()
        from . import cuda_sdk

        blas = cuda_sdk.find_cublas(nvcc_path())
        if blas is not None:
            out["cublas"] = blas.describe()
    return out


def worker_devices(worker: Path, backend: str) -> list[str]:
    """The accelerator devices a built dgr-worker sees (``--smoke``), e.g.
    ``0 = llvmpipe (LLVM 15.0.6, 256 bits) | uma: 1 | fp16: 1 | …`` for Mesa's llvmpipe."""
    if backend not in ("vulkan", "cuda", "hip") or not worker.is_file():
        return []
    env = dict(os.environ)
    if backend == "vulkan":
        env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    try:
        r = subprocess.run([str(worker), "--smoke"], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return []
    tag = {"vulkan": "ggml_vulkan", "cuda": "ggml_cuda_init", "hip": "ggml_cuda_init"}[backend]
    out = []
    for line in (r.stdout + r.stderr).splitlines():
        m = re.match(rf"\s*{tag}:\s+(?:Device\s+)?(\d+)\s*[=:]\s*(.+)$", line)
        if m:
            out.append(f"{m.group(1)} = {m.group(2).strip()}")
    return out
