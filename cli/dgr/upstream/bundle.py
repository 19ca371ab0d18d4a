"""Over 500 lines on purpose: everything that makes and checks one bundle, in the order it is made.

A relocatable bundle of the worker and the llama.cpp yardsticks for a lent GPU machine
(`dgr build --bundle OUT_DIR`, ``tools/gpu-bundle.sh``; docs/backends.md, "Running the GPU check
on a lent machine").

The lent machine has a GPU, CUDA's compiler and a Python with numpy, grpcio and protobuf, but no
gRPC C++ libraries, no package registry and no network; what reaches it is the git working tree
plus a few carried ignored folders, 64 MiB in all. A bundle is one such folder:

    OUT_DIR/dgr-bundle.json   this manifest (schema dgr.bundle/1): what is inside, sizes, sha256,
                              what the machine must provide
    OUT_DIR/bundle.tar.xz     the programs and libraries (xz: about a third of their size)
    OUT_DIR/wheels/           (--wheels) the Python packages dgr needs that the machine lacks
    OUT_DIR/debs/             (with a Vulkan build) the Vulkan loader and the GL dispatch .debs
                              (:data:`LOADER_DEBS`), unpacked there only when the machine lacks
                              libvulkan.so.1 (``tools/gpu-check.sh``: ``dpkg -x`` into its work
                              folder, never over /)

Unpacked (``tools/gpu-check.sh`` does it into its work folder; that folder is then the build dir,
``DGR_BUILD_DIR``, so dgr finds the programs where it looks for built ones):

    <backend>/bin/            dgr-worker, llama-bench, llama-batched-bench, and what differs per
                              backend: libggml.so (the backend registry), libggml-cuda.so,
                              libggml-vulkan.so
    <backend>/dgr-toolchain.json
    lib/                      what every backend shares: libllama, libllama-common, libggml-base,
                              libggml-cpu, the tools' libraries (one copy when their bytes are
                              equal in every backend's build), and the distribution libraries
                              the programs link (gRPC, protobuf, abseil, OpenSSL, prometheus-cpp,
                              zlib, libgomp, ...)
    dgr-bundle.json

Every program and library finds the others through its RPATH ``$ORIGIN:$ORIGIN/../../lib``
(DT_RPATH: it also applies to the libraries' own dependencies). Each backend is built by
:func:`dgr.upstream.build.build` with ``shared=True`` in build/gpu-bundle-<backend>/ (the pin
check, the patched tree, the same CMake flags, ccache), never in build/<backend>/. A CUDA bundle
also holds the CPU build (a mixed cpu,cuda route needs a CPU worker); ``vulkan=True`` (``dgr build
--bundle OUT --backend cuda --vulkan``) adds the Vulkan build (the Vulkan worker on the NVIDIA
driver) and the loader .debs; ``--backend vulkan`` is a cpu+vulkan bundle. Nothing builds inside a
bundle (:func:`dgr.upstream.build.refuse_in_bundle`). Not carried: glibc, libstdc++/libgcc_s
(the machine's own, newer) and the NVIDIA driver, CUDA runtime and cuBLAS (hundreds of MiB; the
machine has them): the manifest names them under ``needs``. The Vulkan loader stays a machine
library too (``needs``): the carried .debs stand in for it only where the machine lacks it.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .. import __version__, paths
from ..digest import sha256_file
from ..errors import DgrError
from . import build as build_mod

SCHEMA = "dgr.bundle/1"
ARCHIVE = "bundle.tar.xz"
TARGETS = ("dgr-worker", "llama-bench", "llama-batched-bench")
MiB = 1 << 20
#: What may travel to the lent machine in one call: the working tree plus carried paths.
TRAVEL_LIMIT_BYTES = 64 * MiB
#: Kept free under the limit: files the session adds before the call, logs, a second look.
DEFAULT_MARGIN_BYTES = 8 * MiB
XZ_PRESET = 6

#: Libraries the target machine has (glibc, the compiler runtime) or must have (driver, CUDA,
#: cuBLAS, the Vulkan loader): never copied.
SYSTEM_LIBS = re.compile(r"^(linux-vdso|ld-linux|libc\.so|libm\.so|libmvec|libpthread|libdl\.so|librt\.so|libutil|"
                         r"libresolv|libstdc\+\+|libgcc_s)")
MACHINE_LIBS = re.compile(r"^(libcuda\.so|libcudart|libcublas|libcublasLt|libnvidia|libnvrtc|libvulkan)")
#: Libraries of the build that differ per backend by design: they stay in <backend>/bin.
PER_BACKEND_LIBS = re.compile(r"^libggml(-(cuda|vulkan|hip|metal))?\.so")

#: Python packages dgr imports on the check's paths that the lent machine's Python lacks or may
#: hold in too old a version (the generated protocol code needs grpcio and protobuf at least as
#: new as its generator's); pure Python except grpcio. The versions are this venv's.
WHEELS = ("grpcio", "protobuf", "grpcio-health-checking", "gguf", "GitPython", "gitdb", "smmap")
WHEEL_PYTHON = "3.12"   # the lent machine's python3 (KINDS.md)
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64", "manylinux1_x86_64")


#: Backends a bundle can hold (each a shared tree build/gpu-bundle-<backend>/); cpu is always in.
BUNDLE_BACKENDS = ("cpu", "cuda", "vulkan")
#: The .debs a bundle with a Vulkan build carries, by package name (``apt-get download``, this
#: machine's Debian release): the worker and libggml-vulkan load only the loader, libvulkan.so.1
#: (ldd); NVIDIA's Vulkan driver (its ICD, libGLX_nvidia.so.0) loads libGLdispatch.so.0 from
#: libglvnd0, and the lent machine's notes bring the GL/EGL/GLX/GLES dispatch libraries with
#: them. 0.36 MiB together (bookworm's, measured); each needs only glibc 2.34.
LOADER_DEBS = ("libvulkan1", "libglvnd0", "libegl1", "libgles2", "libgl1", "libglx0", "libopengl0")
DEB_ARCH = "amd64"


def bundle_backends(backend: str, vulkan: bool = False) -> list[str]:
    """The backends a bundle of ``backend`` holds, in build order: always cpu (a mixed route
    needs a CPU worker), then ``backend``, then vulkan with ``vulkan``."""
    if backend not in BUNDLE_BACKENDS:
        raise DgrError(f"a bundle is built for {', '.join(BUNDLE_BACKENDS)}, not {backend!r}")
    out = ["cpu"]
    for b in (backend, "vulkan" if vulkan else None):
        if b and b not in out:
            out.append(b)
    return out


def shared_build_dir(backend: str) -> Path:
    return paths.build_dir() / f"gpu-bundle-{backend}"


def wheel_cache_dir() -> Path:
    return paths.build_dir() / "gpu-bundle-wheels"


def deb_cache_dir() -> Path:
    return paths.build_dir() / "gpu-bundle-debs"


def travelling_tree_bytes(root: Path | None = None) -> int:
    """Bytes of the working tree that travels (tracked plus untracked files git does not ignore)."""
    root = root or paths.repo_root()
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=False)
    if out.returncode != 0:
        raise DgrError(f"git ls-files failed in {root}: {out.stderr.decode(errors='replace').strip()}")
    total = 0
    for name in {n for n in out.stdout.decode().split("\0") if n}:
        p = root / name
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def _ldd(path: Path) -> list[tuple[str, str | None]]:
    """(needed name, resolved path or None) for every library ``path`` loads (ldd)."""
    r = subprocess.run(["ldd", str(path)], capture_output=True, text=True)
    rows: list[tuple[str, str | None]] = []
    for line in r.stdout.splitlines():
        line = line.strip()
        m = re.match(r"^(\S+) => (not found|(\S+)) \(0x[0-9a-f]+\)$", line) or re.match(r"^(\S+) => (not found)$", line)
        if m:
            rows.append((m.group(1), None if m.group(2) == "not found" else m.group(2)))
        elif re.match(r"^(/\S+) \(0x", line):
            rows.append((Path(line.split()[0]).name, line.split()[0]))
    return rows


def _strip(path: Path, shared: bool) -> None:
    if shutil.which("strip") is None:
        return
    subprocess.run(["strip", "--strip-unneeded" if shared else "--strip-all", str(path)], check=True)


def _symbol_versions(paths_: list[Path]) -> dict[str, str]:
    """The newest GLIBC_, GLIBCXX_ and CXXABI_ symbol versions the files need (what the target's
    glibc and libstdc++ must provide)."""
    best: dict[str, tuple[int, ...]] = {}
    if shutil.which("objdump") is None:
        return {}
    for p in paths_:
        text = subprocess.run(["objdump", "-T", str(p)], capture_output=True, text=True).stdout
        for tag, ver in re.findall(r"\b(GLIBC|GLIBCXX|CXXABI)_(\d+(?:\.\d+)*)\b", text):
            v = tuple(int(x) for x in ver.split("."))
            if v > best.get(tag, ()):
                best[tag] = v
    return {tag: ".".join(map(str, v)) for tag, v in sorted(best.items())}


def _check_out_dir(out: Path) -> None:
    """OUT_DIR must be an ignored folder of the checkout (carried, never travelling twice) and
    either absent, empty, or an earlier bundle (it is replaced)."""
    root = paths.repo_root()
    try:
        out.resolve().relative_to(root.resolve())
    except ValueError:
        raise DgrError(f"{out} is outside the checkout {root}: only the checkout's paths can be carried",
                       hint="use a folder under build/, e.g. build/bundle-cuda") from None
    if subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(out.resolve())]).returncode != 0:
        raise DgrError(f"{out} is not ignored by git: it would travel with the tree and again as a carried path",
                       hint="use a folder under build/, e.g. build/bundle-cuda")
    if out.exists() and any(out.iterdir()) and not (out / build_mod.BUNDLE_MANIFEST).is_file():
        raise DgrError(f"{out} exists and is not a bundle ({build_mod.BUNDLE_MANIFEST} missing): not replacing it")


def fetch_wheels(dest: Path) -> list[dict]:
    """The :data:`WHEELS` at this venv's versions for the lent machine's Python, downloaded once
    into build/gpu-bundle-wheels/ (pip download, by name and version, no dependencies) and
    copied into ``dest``."""
    from importlib.metadata import PackageNotFoundError, version

    cache = wheel_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    out: list[dict] = []
    for name in WHEELS:
        try:
            ver = version(name)
        except PackageNotFoundError:
            raise DgrError(f"{name} is not installed here: the bundle carries this venv's version of it") from None
        norm = re.sub(r"[-_.]+", "_", name).lower()
        have = [w for w in cache.glob("*.whl") if w.name.lower().startswith(f"{norm}-{ver}-")]
        if not have:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                   "-q", "--python-version", WHEEL_PYTHON, "--implementation", "cp", "-d", str(cache)]
            for plat in WHEEL_PLATFORMS:
                cmd += ["--platform", plat]
            r = subprocess.run([*cmd, f"{name}=={ver}"], capture_output=True, text=True)
            have = [w for w in cache.glob("*.whl") if w.name.lower().startswith(f"{norm}-{ver}-")]
            if r.returncode != 0 or not have:
                tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
                raise DgrError(f"pip download {name}=={ver} (Python {WHEEL_PYTHON}, manylinux x86-64) failed: {tail[0]}")
        whl = sorted(have)[-1]
        shutil.copyfile(whl, dest / whl.name)
        out.append({"name": name, "version": ver, "file": f"wheels/{whl.name}", "bytes": whl.stat().st_size,
                    "sha256": sha256_file(whl)})
    return out



# ---- the loader .debs ---------------------------------------------------------------------------

def _ar_members(data: bytes) -> dict[str, bytes]:
    """The members of an ar archive (a .deb is one: debian-binary, control.tar.*, data.tar.*)."""
    if not data.startswith(b"!<arch>\n"):
        raise DgrError("not an ar archive (a .deb starts with !<arch>)")
    out: dict[str, bytes] = {}
    pos = 8
    while pos + 60 <= len(data):
        head = data[pos:pos + 60]
        name = head[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(head[48:58].decode("ascii").strip() or 0)
        out[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    return out


def _deb_tar(deb: Path, prefix: str) -> tarfile.TarFile:
    import io

    members = _ar_members(deb.read_bytes())
    name = next((n for n in members if n.startswith(prefix + ".tar")), None)
    if name is None:
        raise DgrError(f"{deb} holds no {prefix}.tar.*")
    if name.endswith(".zst"):
        raise DgrError(f"{deb}: {name} is zstd-compressed (unpack it with dpkg -x)")
    return tarfile.open(fileobj=io.BytesIO(members[name]), mode="r:*")


def deb_fields(deb: Path) -> dict[str, str]:
    """The control fields of a .deb (Package, Version, Architecture, Depends, ...)."""
    with _deb_tar(deb, "control") as tf:
        member = next((m for m in tf.getmembers() if m.name.lstrip("./") == "control"), None)
        text = tf.extractfile(member).read().decode() if member is not None else ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if line[:1] not in (" ", "\t") and ":" in line:
            k, _, v = line.partition(":")
            fields[k.strip()] = v.strip()
    return fields


def deb_libraries(deb: Path) -> list[str]:
    """The shared libraries (file names, e.g. libvulkan.so.1) a .deb installs."""
    with _deb_tar(deb, "data") as tf:
        names = [Path(m.name).name for m in tf.getmembers() if m.isfile() or m.issym()]
    return sorted({n for n in names if re.match(r"^lib[^/]*\.so(\.\d+)+$", n)})


def unpack_deb(deb: Path, dest: Path) -> None:
    """``dpkg -x deb dest`` without dpkg: the data members under ``dest`` (never over /)."""
    dest.mkdir(parents=True, exist_ok=True)
    with _deb_tar(deb, "data") as tf:
        tf.extractall(dest, filter="data")


def fetch_debs(dest: Path, packages: tuple[str, ...] = LOADER_DEBS) -> list[dict]:
    """``packages`` as .debs of this machine's release (``apt-get download``, by name), downloaded
    once into build/gpu-bundle-debs/ and copied into ``dest``. Nothing is installed; where the
    machine's apt lists are missing, a private list folder there is updated first."""
    cache = deb_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)

    def cached(pkg: str) -> list[Path]:
        return sorted(cache.glob(f"{pkg}_*_{DEB_ARCH}.deb"))

    lacking = [p for p in packages if not cached(p)]
    if lacking:
        if shutil.which("apt-get") is None:
            raise DgrError(f"the Vulkan bundle carries {', '.join(lacking)} (.debs) and apt-get is not here",
                           hint=f"put {' '.join(lacking)} .debs ({DEB_ARCH}) into {cache}")
        arch = [f"-oAPT::Architecture={DEB_ARCH}", f"-oAPT::Architectures={DEB_ARCH}"]
        r = subprocess.run(["apt-get", *arch, "download", *lacking], cwd=cache, capture_output=True, text=True)
        if r.returncode != 0:   # no lists here: a private list folder, the machine's sources
            lists = cache / "lists"
            (lists / "partial").mkdir(parents=True, exist_ok=True)
            opts = [*arch, f"-oDir::State::Lists={lists}"]
            subprocess.run(["apt-get", *opts, "-qq", "update"], capture_output=True, text=True)
            r = subprocess.run(["apt-get", *opts, "download", *lacking], cwd=cache, capture_output=True, text=True)
        missing = [p for p in lacking if not cached(p)]
        if missing:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
            raise DgrError(f"apt-get download {' '.join(missing)} failed: {tail[0]}",
                           hint=f"or put their .debs ({DEB_ARCH}) into {cache}")
    rows = []
    for pkg in packages:
        deb = cached(pkg)[-1]
        shutil.copyfile(deb, dest / deb.name)
        f = deb_fields(deb)
        rows.append({"package": pkg, "version": f.get("Version"), "architecture": f.get("Architecture"),
                     "depends": f.get("Depends"), "libraries": deb_libraries(deb), "file": f"debs/{deb.name}",
                     "bytes": deb.stat().st_size, "sha256": sha256_file(deb)})
    return rows


def _assemble(stage: Path, backends: list[str]) -> set[str]:
    """Copy the built programs and every library they load (but the machine's) into ``stage``
    (the unpacked layout), stripped; libraries of the build whose bytes are equal in every
    backend (and not :data:`PER_BACKEND_LIBS`) go to lib/ once. Returns the machine libraries
    the programs need."""
    needs: set[str] = set()
    local: dict[str, dict[str, Path]] = {}      # library name -> backend -> stripped copy
    system: dict[str, Path] = {}                # distribution library name -> resolved path
    scratch = stage / ".strip"
    for b in backends:
        src_dir = shared_build_dir(b)
        src_bin = src_dir / "bin"
        dst_bin = stage / b / "bin"
        dst_bin.mkdir(parents=True)
        for name in TARGETS:
            exe = src_bin / name
            if not exe.is_file():
                raise DgrError(f"{exe} not built", hint="dgr build --bundle OUT_DIR --backend cpu|cuda|vulkan")
            shutil.copy2(exe, dst_bin / name)
            _strip(dst_bin / name, shared=False)
            for needed, resolved in _ldd(exe):
                if SYSTEM_LIBS.match(needed):
                    continue
                if MACHINE_LIBS.match(needed):
                    needs.add(needed)
                    continue
                if resolved is None:
                    raise DgrError(f"{name} needs {needed}, which is not found here (ldd {exe})")
                rp = Path(resolved).resolve()
                if src_bin.resolve() in rp.parents:
                    if b not in local.setdefault(needed, {}):
                        tmp = scratch / b / needed
                        tmp.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(rp, tmp)
                        _strip(tmp, shared=True)
                        local[needed][b] = tmp
                else:
                    system.setdefault(needed, rp)
        for extra in sorted(src_bin.glob("llama.cpp-*")):
            shutil.copyfile(extra, dst_bin / extra.name)
        rec = src_dir / build_mod.TOOLCHAIN_RECORD
        if rec.is_file():
            shutil.copyfile(rec, stage / b / build_mod.TOOLCHAIN_RECORD)
    lib = stage / "lib"
    lib.mkdir()
    for name, rp in sorted(system.items()):
        shutil.copyfile(rp, lib / name)
    for name, copies in sorted(local.items()):
        digests = {sha256_file(p) for p in copies.values()}
        if len(copies) == len(backends) and len(digests) == 1 and not PER_BACKEND_LIBS.match(name):
            shutil.copyfile(next(iter(copies.values())), lib / name)
        else:
            for b, p in copies.items():
                shutil.copyfile(p, stage / b / "bin" / name)
    for p in stage.rglob("*"):
        if p.is_file() and (p.parent.name in ("bin", "lib")) and not p.name.startswith("llama.cpp-"):
            p.chmod(0o755)
    shutil.rmtree(scratch, ignore_errors=True)
    return needs


def _pack(stage: Path, archive: Path) -> None:
    """``stage`` as a reproducible tar.xz (sorted, owner root, mtime 0)."""
    def norm(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        ti.mtime = 0
        return ti

    with lzma.open(archive, "wb", preset=XZ_PRESET) as xz, tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for p in sorted(stage.rglob("*")):
            tf.add(p, arcname=p.relative_to(stage).as_posix(), recursive=False, filter=norm)


def unpack(bundle_dir: Path, dest: Path) -> dict:
    """Check ``bundle_dir``'s archive against its manifest and unpack it into ``dest`` (which
    then serves as DGR_BUILD_DIR); returns the manifest."""
    manifest = json.loads((bundle_dir / build_mod.BUNDLE_MANIFEST).read_text())
    arc = bundle_dir / manifest["archive"]["file"]
    if sha256_file(arc) != manifest["archive"]["sha256"]:
        raise DgrError(f"{arc} does not match its manifest's sha256")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(arc, "r:xz") as tf:
        tf.extractall(dest, filter="data")
    return manifest


def _previous_archive(out: Path) -> tuple[dict, bytes] | None:
    """(its files, the archive's bytes) of an earlier bundle in ``out`` whose archive is intact."""
    try:
        doc = json.loads((out / build_mod.BUNDLE_MANIFEST).read_text())
        data = (out / doc["archive"]["file"]).read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if hashlib.sha256(data).hexdigest() != doc["archive"].get("sha256"):
        return None
    return doc.get("files"), data


#: SASS for sm_90 (H100, H200) only: the PTX that "90" adds (for JIT on later GPUs) doubles
#: libggml-cuda (measured: 36.7 MiB of xz with it, the whole CUDA bundle then over the limit).
DEFAULT_CUDA_ARCH = "90-real"


def make_bundle(out: Path, backend: str = "cuda", *, cuda_arch: str = DEFAULT_CUDA_ARCH, jobs: int | None = None,
                wheels: bool | None = None, limit_bytes: int = TRAVEL_LIMIT_BYTES,
                margin_bytes: int = DEFAULT_MARGIN_BYTES, build: bool = True, vulkan: bool = False) -> dict:
    """Build (``build``) and assemble the bundle of ``backend`` (cpu, cuda or vulkan; ``vulkan``:
    a Vulkan build as well, with the loader .debs) into ``out``; returns the manifest. Refuses
    (and removes ``out``) when what is carried plus the travelling tree would exceed
    ``limit_bytes - margin_bytes``. ``wheels``: default on for an accelerator bundle."""
    backends = bundle_backends(backend, vulkan)
    build_mod.refuse_in_bundle()
    out = Path(out)
    _check_out_dir(out)
    wheels = (backend != "cpu") if wheels is None else wheels
    timings: dict[str, float] = {}
    if build:
        for b in backends:
            if b == "cuda":
                os.environ["CUDAARCHS"] = cuda_arch
            t0 = time.monotonic()
            build_mod.build(b, jobs=jobs, targets=TARGETS, shared=True, build_dir=shared_build_dir(b))
            timings[b] = round(time.monotonic() - t0, 1)
    previous = _previous_archive(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    pin = build_mod.pin_mod.load_pin()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=paths.build_dir(), prefix=".bundle-stage-") as tmp:
        stage = Path(tmp)
        needs = _assemble(stage, backends)
        files = {p.relative_to(stage).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                 for p in sorted(stage.rglob("*")) if p.is_file()}
        programs = [p for p in stage.rglob("*") if p.is_file() and p.parent.name in ("bin", "lib")
                    and not p.name.startswith("llama.cpp-")]
        symbol_versions = _symbol_versions(programs)
        doc = {
            "kind": SCHEMA,
            "backend": backend,
            "backends": backends,
            "targets": list(TARGETS),
            "cuda_architectures": cuda_arch if "cuda" in backends else None,
            "dgr_version": __version__,
            "git_commit": _git_commit(),
            # files that differ from that commit (changed or untracked): what travels is the
            # working tree, not the commit
            "git_dirty_files": _git_dirty(),
            "pin_commit": pin.commit,
            "cmake": list(build_mod.SHARED_CMAKE) + list(build_mod.portable_cmake(backend)),
            "cmake_per_backend": {b: list(build_mod.portable_cmake(b)) for b in backends},
            "build_seconds": timings,
            "layout": {"programs": "<backend>/bin", "per_backend_libraries": "<backend>/bin",
                       "shared_libraries": "lib", "rpath": "$ORIGIN:$ORIGIN/../../lib (DT_RPATH)"},
            "needs": {"symbol_versions": symbol_versions, "machine_libraries": sorted(needs),
                      "python": {"version": WHEEL_PYTHON, "preinstalled": ["numpy", "typer", "jinja2", "prometheus-client"]}},
            "files": files,
            "unpacked_bytes": sum(f["bytes"] for f in files.values()),
        }
        # the manifest travels inside too: the unpacked folder is a bundle (build.bundle_manifest)
        (stage / build_mod.BUNDLE_MANIFEST).write_text(json.dumps(doc, indent=1) + "\n")
        reused = previous is not None and previous[0] == files
        if reused:   # the same programs and libraries: the archive made last time (xz takes a minute)
            (out / ARCHIVE).write_bytes(previous[1])
        else:
            _pack(stage, out / ARCHIVE)
    pack_s = round(time.monotonic() - t0, 1)
    wheel_rows = fetch_wheels(out / "wheels") if wheels else []
    deb_rows = fetch_debs(out / "debs") if "vulkan" in backends else []
    archive_bytes = (out / ARCHIVE).stat().st_size
    tree = travelling_tree_bytes()
    doc.update({
        "archive": {"file": ARCHIVE, "bytes": archive_bytes, "sha256": sha256_file(out / ARCHIVE),
                    "xz_preset": XZ_PRESET, "seconds": pack_s, "reused": reused},
        "wheels": wheel_rows,
        # the Vulkan loader where the machine lacks it (unpacked by tools/gpu-check.sh, never over /)
        "debs": deb_rows,
        "tree_bytes": tree,
        "limit_bytes": limit_bytes,
        "margin_bytes": margin_bytes,
    })
    manifest_bytes = len(json.dumps(doc, indent=1)) + 512
    doc["bundle_bytes"] = (archive_bytes + sum(w["bytes"] for w in wheel_rows) + sum(d["bytes"] for d in deb_rows)
                           + manifest_bytes)
    doc["travel_bytes"] = doc["bundle_bytes"] + tree
    doc["fits"] = doc["travel_bytes"] <= limit_bytes - margin_bytes
    if not doc["fits"]:
        shutil.rmtree(out)
        raise DgrError(f"the bundle is {doc['bundle_bytes'] / MiB:.1f} MiB and the tree that travels {tree / MiB:.1f} MiB: "
                       f"{doc['travel_bytes'] / MiB:.1f} MiB, over the {limit_bytes / MiB:.0f} MiB limit less "
                       f"{margin_bytes / MiB:.0f} MiB kept free; removed {out}",
                       hint="fewer CUDA architectures (--cuda-arch 90-real), --no-wheels, no --vulkan (or a "
                            "bundle of its own: --backend vulkan), or a smaller tree")
    (out / build_mod.BUNDLE_MANIFEST).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _git_commit() -> str | None:
    r = subprocess.run(["git", "-C", str(paths.repo_root()), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or None


def _git_dirty() -> int | None:
    r = subprocess.run(["git", "-C", str(paths.repo_root()), "status", "--porcelain"], capture_output=True, text=True)
    return len([ln for ln in r.stdout.splitlines() if ln.strip()]) if r.returncode == 0 else None


def summary(doc: dict) -> str:
    by_dir: dict[str, int] = {}
    for rel, f in doc["files"].items():
        parts = rel.split("/")
        top = "/".join(parts[:2]) if parts[0] in doc["backends"] and len(parts) > 2 else parts[0] if len(parts) > 1 else "."
        by_dir[top] = by_dir.get(top, 0) + f["bytes"]
    arc = doc["archive"]
    lines = [f"bundle {doc['backend']} ({', '.join(doc['backends'])})"
             + (f", CUDA architectures {doc['cuda_architectures']}" if doc.get("cuda_architectures") else "")
             + f": {doc['unpacked_bytes'] / MiB:.1f} MiB unpacked, stripped:"]
    for d, n in sorted(by_dir.items()):
        lines.append(f"  {d:<12} {n / MiB:6.1f} MiB")
    lines.append(f"carried: {arc['file']} {arc['bytes'] / MiB:.1f} MiB (xz -{arc['xz_preset']}"
                 + (", unchanged: reused" if arc.get("reused") else f", {arc['seconds']} s") + ")"
                 + (f" + wheels {sum(w['bytes'] for w in doc['wheels']) / MiB:.1f} MiB ({len(doc['wheels'])})"
                    if doc["wheels"] else "")
                 + (f" + debs {sum(d['bytes'] for d in doc.get('debs') or []) / MiB:.2f} MiB ({len(doc['debs'])}: "
                    f"the Vulkan loader where the machine lacks it)" if doc.get("debs") else "")
                 + f" = {doc['bundle_bytes'] / MiB:.1f} MiB")
    lines.append(f"tree that travels {doc['tree_bytes'] / MiB:.1f} MiB; together {doc['travel_bytes'] / MiB:.1f} MiB "
                 f"of {doc['limit_bytes'] / MiB:.0f} MiB ({doc['margin_bytes'] / MiB:.0f} MiB kept free): fits")
    if doc["needs"]["machine_libraries"]:
        lines.append("the machine provides: " + ", ".join(doc["needs"]["machine_libraries"]))
    if doc["needs"]["symbol_versions"]:
        lines.append("needs at least: " + ", ".join(f"{k} {v}" for k, v in doc["needs"]["symbol_versions"].items()))
    return "\n".join(lines)
