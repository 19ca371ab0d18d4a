"""cuBLAS for the CUDA build, when the machine's CUDA toolkit has ``nvcc`` but not cuBLAS.

ggml-cuda includes ``cublas_v2.h`` and links cuBLAS. A toolkit assembled from NVIDIA's Python
wheels (nvcc, cudart, …) may lack it; then the ``nvidia-cublas`` wheel of the same CUDA
major.minor as ``nvcc`` is downloaded with pip (by package name, no dependencies) into
``build/cuda-sdk/`` and unpacked there; nothing is installed. The wheel's sha256 is recorded
(``build/cuda-sdk/sdk.json`` and the build's toolchain record) and every unpacked file is
checked against the wheel's own RECORD hashes.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..errors import DgrError


@dataclass(frozen=True)
class Cublas:
    root: Path            # has include/cublas_v2.h and lib*/libcublas.so*
    include_dir: Path
    library: Path
    library_lt: Path
    source: str           # "toolkit" or "build/cuda-sdk (nvidia-cublas X, sha256 …)"

    def describe(self) -> str:
        return f"{self.source}: {self.root}"


def sdk_dir() -> Path:
    return paths.build_dir() / "cuda-sdk"


def _lib(d: Path, name: str) -> Path | None:
    for cand in (d / f"lib{name}.so", *sorted(d.glob(f"lib{name}.so.*"))):
        if cand.exists():
            return cand
    return None


def _from_root(root: Path, source: str) -> Cublas | None:
    inc = root / "include"
    if not (inc / "cublas_v2.h").is_file():
        return None
    for libdir in (root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"):
        lib, lt = _lib(libdir, "cublas"), _lib(libdir, "cublasLt")
        if lib and lt:
            return Cublas(root, inc, lib, lt, source)
    return None


def toolkit_root(nvcc: str | None) -> Path | None:
    return Path(nvcc).resolve().parent.parent if nvcc else None


def find_cublas(nvcc: str | None) -> Cublas | None:
    """cuBLAS from the toolkit of ``nvcc``, or from an earlier download into build/cuda-sdk."""
    root = toolkit_root(nvcc)
    if root is not None:
        found = _from_root(root, "toolkit")
        if found:
            return found
    try:
        meta = json.loads((sdk_dir() / "sdk.json").read_text())
        return _from_root(Path(meta["root"]), f"build/cuda-sdk (nvidia-cublas {meta['version']}, "
                                               f"wheel sha256 {meta['sha256']})")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def driver_library(nvcc: str | None) -> Path | None:
    """libcuda.so of the driver, or the toolkit's link stub (lib64/stubs/libcuda.so)."""
    root = toolkit_root(nvcc)
    cands = [Path(d) / "libcuda.so" for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu")]
    cands += [Path(d) / "libcuda.so.1" for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu")]
    if root is not None:
        cands += [root / "lib64" / "stubs" / "libcuda.so", root / "lib" / "stubs" / "libcuda.so"]
    return next((p for p in cands if p.exists()), None)


def cuda_release(nvcc: str) -> tuple[int, int]:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise DgrError(f"cannot read the CUDA release from `{nvcc} --version`")
    return int(m.group(1)), int(m.group(2))


def _check_record(zf: zipfile.ZipFile) -> None:
    """Every file of the wheel against its RECORD sha256 (urlsafe base64, no padding)."""
    rec_name = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if rec_name is None:
        raise DgrError("the nvidia-cublas wheel has no RECORD")
    for row in csv.reader(io.StringIO(zf.read(rec_name).decode())):
        if len(row) < 2 or not row[1]:
            continue
        algo, _, want = row[1].partition("=")
        if algo != "sha256":
            continue
        got = base64.urlsafe_b64encode(hashlib.sha256(zf.read(row[0])).digest()).rstrip(b"=").decode()
        if got != want:
            raise DgrError(f"nvidia-cublas wheel: {row[0]} does not match its RECORD hash")


def fetch_cublas(nvcc: str) -> Cublas:
    major, minor = cuda_release(nvcc)
    dest = sdk_dir()
    wheels = dest / "wheels"
    if dest.exists():
        shutil.rmtree(dest)
    wheels.mkdir(parents=True)
    spec = f"nvidia-cublas=={major}.{minor}.*"
    print(f"downloading {spec} (cuBLAS for CUDA {major}.{minor}) into {wheels}; installs nothing",
          file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "--disable-pip-version-check", "-q", "-d", str(wheels), spec],
                       capture_output=True, text=True)
    got = sorted(wheels.glob("nvidia_cublas-*.whl"))
    if r.returncode != 0 or len(got) != 1:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
        raise DgrError(f"pip download {spec} failed: {tail[0]}",
                       hint="install cuBLAS into the CUDA toolkit (include/cublas_v2.h, lib64/libcublas.so)")
    whl = got[0]
    digest = hashlib.sha256(whl.read_bytes()).hexdigest()
    version = whl.name.split("-")[1]
    root_out = dest / "root"
    with zipfile.ZipFile(whl) as zf:
        _check_record(zf)
        zf.extractall(root_out)
    inc = sorted(root_out.glob("nvidia/*/include/cublas_v2.h")) or sorted(root_out.glob("nvidia/**/cublas_v2.h", recursive=True))
    if not inc:
        raise DgrError(f"{whl.name} has no cublas_v2.h")
    root = inc[0].parent.parent
    whl.unlink()   # the unpacked tree is what the build uses
    (dest / "sdk.json").write_text(json.dumps({"root": str(root), "version": version, "sha256": digest,
                                               "wheel": whl.name, "cuda": f"{major}.{minor}"}, indent=1) + "\n")
    found = _from_root(root, f"build/cuda-sdk (nvidia-cublas {version}, wheel sha256 {digest})")
    if found is None:
        raise DgrError(f"{whl.name} unpacked without libcublas/libcublasLt under {root}")
    return found


def ensure(nvcc: str) -> Cublas:
    return find_cublas(nvcc) or fetch_cublas(nvcc)


def cmake_flags(blas: Cublas) -> list[str]:
    if blas.source == "toolkit":
        return []
    inc = f"-I{blas.include_dir}"
    return [f"-DCUDA_cublas_LIBRARY={blas.library}", f"-DCUDA_cublasLt_LIBRARY={blas.library_lt}",
            f"-DCMAKE_CUDA_FLAGS={inc}", f"-DCMAKE_CXX_FLAGS={inc}", f"-DCMAKE_C_FLAGS={inc}"]
