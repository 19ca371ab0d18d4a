"""The Vulkan toolchain of the pinned ggml-vulkan, obtained on a Debian machine without
installing anything over the system's own packages.

The pinned ggml-vulkan needs Vulkan headers with ``VK_EXT_layer_settings`` (1.4.309 is known to
work); Debian bookworm ships 1.3.239. Two kinds of things are needed:

* from the distribution, installed with apt (``SYSTEM_PACKAGES``): the GLSL compiler ``glslc``,
  the Vulkan loader ``libvulkan1`` and Mesa's Vulkan drivers (llvmpipe: Vulkan on the CPU);
* newer headers (``HEADER_PACKAGES``: ``libvulkan-dev``, ``spirv-headers``) from the next
  Debian release, downloaded with apt into a throwaway apt state under ``build/vulkan-sdk/apt``
  and unpacked with ``dpkg -x`` into ``build/vulkan-sdk/root``. The source line is the machine's
  own Debian source with the suite replaced, so no host name is written anywhere by dgr. Each
  ``.deb`` is checked against the SHA256 in the Packages index apt downloaded (itself verified
  by apt against the signed Release file); the versions and hashes are recorded in
  ``build/vulkan-sdk/sdk.json`` and in the build's toolchain record.

``DGR_VULKAN_PREFIX`` points at a prefix that already has new enough headers (``usr/include``)
and skips the download; headers on the system that are new enough are used as they are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths
from ..digest import sha256_file
from ..errors import DgrError

MIN_HEADER_VERSION = 309          # VK_HEADER_VERSION with VK_EXT_layer_settings that the pin builds with
SYSTEM_PACKAGES = ("glslc", "libvulkan1", "mesa-vulkan-drivers")
HEADER_PACKAGES = ("libvulkan-dev", "spirv-headers")
# The Debian release whose headers are unpacked, per base release (DGR_VULKAN_SUITE overrides).
NEWER_SUITE = {"bookworm": "trixie"}
_LOADER_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def sdk_dir() -> Path:
    return paths.build_dir() / "vulkan-sdk"


def header_version(include_dir: Path) -> int | None:
    """VK_HEADER_VERSION of ``include_dir/vulkan/vulkan_core.h`` when it also has
    VK_EXT_layer_settings; 0 when it lacks it; None when there is no header."""
    h = include_dir / "vulkan" / "vulkan_core.h"
    if not h.is_file():
        return None
    text = h.read_text(errors="replace")
    m = re.search(r"#define VK_HEADER_VERSION (\d+)", text)
    if not m or "VK_EXT_layer_settings" not in text:
        return 0
    return int(m.group(1))


def spirv_config_dir(include_dir: Path) -> Path | None:
    """SPIRV-Headers' CMake package next to ``include_dir`` (ggml-vulkan find_package()s it)."""
    d = include_dir.parent / "share" / "cmake" / "SPIRV-Headers"
    return d if (d / "SPIRV-HeadersConfig.cmake").is_file() else None


def headers_ok(include_dir: Path) -> bool:
    v = header_version(include_dir)
    return v is not None and v >= MIN_HEADER_VERSION and spirv_config_dir(include_dir) is not None


def loader_library() -> Path | None:
    """The system's Vulkan loader (libvulkan.so.1), linked by the worker."""
    for d in _LOADER_DIRS:
        p = Path(d) / "libvulkan.so.1"
        if p.exists():
            return p
    return None


def deb_installed(pkg: str) -> str | None:
    """The installed version of a Debian package, or None."""
    if shutil.which("dpkg-query") is None:
        return None
    r = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Status} ${Version}", pkg],
                       capture_output=True, text=True)
    status, _, version = r.stdout.partition(" ")
    return version if r.returncode == 0 and status == "installed" else None


def missing_system_packages() -> list[str]:
    return [p for p in SYSTEM_PACKAGES if deb_installed(p) is None]


def apt_install_command(pkgs: list[str] | tuple[str, ...]) -> str:
    return "apt-get update && apt-get install -y --no-install-recommends " + " ".join(pkgs)


def install_system_packages(pkgs: list[str]) -> None:
    """apt-get install ``pkgs`` (root only); otherwise one line with the exact command."""
    if not pkgs:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DgrError(f"backend vulkan needs the system packages {' '.join(pkgs)}",
                       hint=f"as root: {apt_install_command(pkgs)}")
    print(f"installing system packages: {' '.join(pkgs)}", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *pkgs]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
            raise DgrError(f"{' '.join(cmd[:2])} failed (exit {r.returncode}): {tail[0]}",
                           hint=f"as root: {apt_install_command(pkgs)}")


# ---- the distribution's own source, with the next suite --------------------------------------

@dataclass(frozen=True)
class AptSource:
    uri: str
    signed_by: str


def _os_release() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            k, _, v = line.partition("=")
            out[k] = v.strip().strip('"')
    except OSError:
        pass
    return out


def base_suite() -> str:
    return _os_release().get("VERSION_CODENAME", "")


def newer_suite() -> str | None:
    return os.environ.get("DGR_VULKAN_SUITE") or NEWER_SUITE.get(base_suite())


def parse_sources(texts: list[tuple[str, str]], suite: str) -> AptSource | None:
    """The first ``deb`` source of ``suite`` with the ``main`` component, from one-line
    (``*.list``) or deb822 (``*.sources``) files given as (file name, text)."""
    for name, text in texts:
        if name.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                f: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line or line[:1].isspace():
                        continue
                    k, _, v = line.partition(":")
                    f[k.strip().lower()] = v.strip()
                if ("deb" in f.get("types", "").split() and suite in f.get("suites", "").split()
                        and "main" in f.get("components", "").split() and f.get("uris")
                        and f.get("enabled", "yes").lower() != "no"):
                    return AptSource(f["uris"].split()[0], f.get("signed-by", ""))
        else:
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                m = re.match(r"deb\s+(?:\[(?P<opts>[^\]]*)\]\s+)?(?P<uri>\S+)\s+(?P<suite>\S+)\s+(?P<comps>.+)", line)
                if m and m["suite"] == suite and "main" in m["comps"].split():
                    opts = dict(o.split("=", 1) for o in (m["opts"] or "").split() if "=" in o)
                    return AptSource(m["uri"], opts.get("signed-by", ""))
    return None


def machine_source(suite: str) -> AptSource | None:
    files = [Path("/etc/apt/sources.list")] + sorted(Path("/etc/apt/sources.list.d").glob("*"))
    texts = []
    for p in files:
        if p.is_file() and p.suffix in (".list", ".sources"):
            try:
                texts.append((p.name, p.read_text(errors="replace")))
            except OSError:
                continue
    return parse_sources(texts, suite)


def source_line(src: AptSource, suite: str) -> str:
    opts = f"[signed-by={src.signed_by}] " if src.signed_by else ""
    return f"deb {opts}{src.uri} {suite} main"


# ---- downloading and unpacking the newer headers ---------------------------------------------

@dataclass
class Sdk:
    include_dir: Path
    source: str                                  # "system", "DGR_VULKAN_PREFIX" or "build/vulkan-sdk"
    header_version: int
    packages: list[dict] = field(default_factory=list)   # name, version, sha256, suite

    def to_json(self) -> dict:
        return {"include_dir": str(self.include_dir), "source": self.source,
                "header_version": self.header_version, "packages": self.packages}


def _apt_opts(state: Path) -> list[str]:
    # pkgcache: kept between the calls (some images disable it, then each call re-parses the index)
    return ["-o", f"Dir::State::Lists={state / 'lists'}", "-o", f"Dir::Etc::SourceList={state / 'sources.list'}",
            "-o", "Dir::Etc::SourceParts=/dev/null", "-o", f"Dir::Cache={state / 'cache'}",
            "-o", f"Dir::Cache::pkgcache={state / 'cache' / 'pkgcache.bin'}",
            "-o", f"Dir::Cache::srcpkgcache={state / 'cache' / 'srcpkgcache.bin'}",
            "-o", "APT::Sandbox::User=root" if os.geteuid() == 0 else "Debug::NoLocking=1"]


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
        raise DgrError(f"{' '.join(cmd[:2])} failed (exit {r.returncode}): {tail[0]}")
    return r.stdout


_PRINT_URI = re.compile(r"^'(?P<uri>[^']+)'\s+(?P<file>\S+)\s+(?P<size>\d+)\s+(?P<hash>\S+)$")


def parse_print_uris(text: str) -> dict[str, dict[str, str]]:
    """``apt-get download --print-uris`` lines (``'URI' FILE SIZE SHA256:HEX``, the size and
    hash from the Packages index) by package name: file, version, size, sha256."""
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        m = _PRINT_URI.match(line.strip())
        if not m:
            continue
        algo, _, digest = m["hash"].partition(":")
        name, _, rest = m["file"].partition("_")
        version = rest.rsplit("_", 1)[0].replace("%3a", ":")
        out[name] = {"file": m["file"], "version": version, "size": m["size"],
                     "sha256": digest.lower() if algo.upper() == "SHA256" else ""}
    return out


def fetch_headers(dest: Path | None = None) -> Sdk:
    """Download HEADER_PACKAGES of the newer suite with a private apt state, check each .deb's
    sha256 against the downloaded Packages index, unpack them into ``dest/root``."""
    dest = dest or sdk_dir()
    suite = newer_suite()
    if suite is None:
        raise DgrError(f"no newer Debian suite known for {base_suite() or 'this system'}: cannot fetch "
                       f"Vulkan headers >= 1.3.{MIN_HEADER_VERSION}",
                       hint="set DGR_VULKAN_SUITE to a suite with libvulkan-dev >= 1.3.309, or unpack "
                            "newer libvulkan-dev + spirv-headers into a prefix and set DGR_VULKAN_PREFIX")
    for tool in ("apt-get", "apt-cache", "dpkg"):
        if shutil.which(tool) is None:
            raise DgrError(f"fetching Vulkan headers needs {tool} (a Debian/Ubuntu system)",
                           hint="unpack libvulkan-dev + spirv-headers >= 1.3.309 into a prefix and set DGR_VULKAN_PREFIX")
    src = machine_source(base_suite())
    if src is None:
        raise DgrError(f"no 'deb … {base_suite()} main' source in /etc/apt/sources.list*; cannot derive "
                       f"the {suite} source", hint="set DGR_VULKAN_PREFIX to a prefix with newer Vulkan headers")
    state = dest / "apt"
    if state.exists():
        shutil.rmtree(state)
    for d in (state / "lists" / "partial", state / "cache" / "archives" / "partial", state / "debs"):
        d.mkdir(parents=True, exist_ok=True)
    (state / "sources.list").write_text(source_line(src, suite) + "\n")
    opts = _apt_opts(state)
    print(f"fetching Vulkan headers from Debian {suite} into {dest} (apt state in {state})",
          file=sys.stderr, flush=True)
    _run(["apt-get", "-q", *opts, "update"])
    # the index's SHA256 of each .deb (apt verified the index against the signed Release file)
    index = parse_print_uris(_run(["apt-get", "-q", *opts, "--print-uris", "download", *HEADER_PACKAGES]))
    _run(["apt-get", "-q", *opts, "download", *HEADER_PACKAGES], cwd=state / "debs")
    root = dest / "root"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    pkgs = []
    for name in HEADER_PACKAGES:
        idx = index.get(name)
        if not idx or not idx["sha256"]:
            raise DgrError(f"the {suite} Packages index gave no SHA256 for {name}")
        deb = state / "debs" / idx["file"]
        if not deb.is_file():
            cands = sorted((state / "debs").glob(f"{name}_*.deb"))
            if len(cands) != 1:
                raise DgrError(f"apt-get download did not leave one {name}_*.deb in {state / 'debs'}")
            deb = cands[0]
        got = sha256_file(deb)
        if got != idx["sha256"]:
            raise DgrError(f"{deb.name}: sha256 {got} does not match the {suite} Packages index ({idx['sha256']})")
        _run(["dpkg", "-x", str(deb), str(root)])
        pkgs.append({"name": name, "version": idx["version"], "sha256": got, "deb": deb.name, "suite": suite})
    inc = root / "usr" / "include"
    v = header_version(inc)
    if v is None or v < MIN_HEADER_VERSION or spirv_config_dir(inc) is None:
        raise DgrError(f"the unpacked headers in {inc} have VK_HEADER_VERSION {v} (need >= {MIN_HEADER_VERSION} "
                       "with VK_EXT_layer_settings) or lack SPIRV-Headers' CMake package")
    sdk = Sdk(inc, "build/vulkan-sdk", v, pkgs)
    (dest / "sdk.json").write_text(json.dumps(sdk.to_json(), indent=1) + "\n")
    return sdk


def find_sdk() -> Sdk | None:
    """Headers new enough for the pin, without downloading: DGR_VULKAN_PREFIX, the system's, or
    a previous fetch in build/vulkan-sdk."""
    prefix = os.environ.get("DGR_VULKAN_PREFIX")
    if prefix:
        inc = Path(prefix) / "usr" / "include"
        return Sdk(inc, "DGR_VULKAN_PREFIX", header_version(inc) or 0) if headers_ok(inc) else None
    sys_inc = Path("/usr/include")
    if headers_ok(sys_inc):
        return Sdk(sys_inc, "system", header_version(sys_inc) or 0)
    meta = sdk_dir() / "sdk.json"
    if meta.is_file():
        try:
            d = json.loads(meta.read_text())
            inc = Path(d["include_dir"])
            if headers_ok(inc):
                return Sdk(inc, d["source"], int(d["header_version"]), list(d.get("packages", [])))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return None


def ensure(*, install: bool = True) -> Sdk:
    """Everything ggml-vulkan needs to build and run here: the system packages (installed with
    apt when root and ``install``) and headers new enough (fetched into build/vulkan-sdk)."""
    missing = missing_system_packages() if shutil.which("dpkg-query") else []
    if missing:
        if install:
            install_system_packages(missing)
        else:
            raise DgrError(f"backend vulkan needs the system packages {' '.join(missing)}",
                           hint=f"as root: {apt_install_command(missing)}")
    if shutil.which("glslc") is None:
        raise DgrError("glslc not found on PATH", hint=f"as root: {apt_install_command(['glslc'])}")
    if loader_library() is None:
        raise DgrError("the Vulkan loader libvulkan.so.1 is not installed",
                       hint=f"as root: {apt_install_command(['libvulkan1'])}")
    sdk = find_sdk()
    if sdk is None:
        if os.environ.get("DGR_VULKAN_PREFIX"):
            prefix = os.environ["DGR_VULKAN_PREFIX"]
            core = Path(prefix) / "usr" / "include" / "vulkan" / "vulkan_core.h"
            m = re.search(r"#define VK_HEADER_VERSION (\d+)", core.read_text(errors="replace")) if core.is_file() else None
            seen = ("no vulkan/vulkan_core.h" if not core.is_file() else
                    f"VK_HEADER_VERSION {m.group(1) if m else '(none)'}")
            raise DgrError(f"DGR_VULKAN_PREFIX={prefix} has {seen} in usr/include; the pinned ggml-vulkan "
                           f"needs headers >= 1.3.{MIN_HEADER_VERSION} with VK_EXT_layer_settings, and "
                           "usr/share/cmake/SPIRV-Headers",
                           hint="unset DGR_VULKAN_PREFIX to let `dgr build --backend vulkan` fetch them "
                                "into build/vulkan-sdk")
        sdk = fetch_headers()
    return sdk


def cmake_flags(sdk: Sdk) -> list[str]:
    flags = [f"-DVulkan_INCLUDE_DIR={sdk.include_dir}"]
    spirv = spirv_config_dir(sdk.include_dir)
    if spirv is not None:
        flags.append(f"-DSPIRV-Headers_DIR={spirv}")
    lib = loader_library()
    if lib is not None:
        flags.append(f"-DVulkan_LIBRARY={lib}")
    glslc = shutil.which("glslc")
    if glslc:
        flags.append(f"-DVulkan_GLSLC_EXECUTABLE={glslc}")
    return flags
