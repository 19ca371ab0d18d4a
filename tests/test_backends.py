"""Backend toolchains without building: the Vulkan header fetch's parsing and checks, the CUDA
cuBLAS lookup, `dgr doctor`, the backend plan of local routes and the drift arithmetic."""

from __future__ import annotations

import json
import math
import sys
import zipfile
from pathlib import Path

import pytest

from dgr.route import drift as rd
from dgr.route import local as rt
from dgr.errors import DgrError
from dgr.upstream import cuda_sdk, doctor, vulkan_sdk as vk

DEB822 = """Types: deb
# a comment
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""


def test_source_line_is_derived_from_the_machines_own_source() -> None:
    src = vk.parse_sources([("debian.sources", DEB822)], "bookworm")
    assert src == vk.AptSource("http://mirror.example/debian", "/usr/share/keyrings/debian-archive-keyring.gpg")
    assert vk.source_line(src, "trixie") == ("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
                                             "http://mirror.example/debian trixie main")
    one_line = "# x\ndeb [arch=amd64 signed-by=/k.gpg] http://m.example/debian bookworm main contrib\n"
    assert vk.parse_sources([("sources.list", one_line)], "bookworm") == vk.AptSource("http://m.example/debian", "/k.gpg")
    assert vk.parse_sources([("sources.list", "deb http://m.example/debian bookworm contrib\n")], "bookworm") is None
    disabled = DEB822.replace("Types: deb\n#", "Types: deb\nEnabled: no\n#", 1)
    assert vk.parse_sources([("d.sources", disabled)], "bookworm") is None


def test_print_uris_gives_the_index_hashes() -> None:
    text = ("'http://m/pool/main/s/spirv-headers/spirv-headers_1.6.1%2b1.4.309.0-1_all.deb' "
            "spirv-headers_1.6.1+1.4.309.0-1_all.deb 151140 SHA256:DC18DB86\n"
            "'http://m/pool/main/v/vulkan-loader/libvulkan-dev_1.4.309.0-1_amd64.deb' "
            "libvulkan-dev_1.4.309.0-1_amd64.deb 1556388 SHA256:8d329d46\nnoise\n")
    got = vk.parse_print_uris(text)
    assert got["spirv-headers"] == {"file": "spirv-headers_1.6.1+1.4.309.0-1_all.deb", "version": "1.6.1+1.4.309.0-1",
                                    "size": "151140", "sha256": "dc18db86"}
    assert got["libvulkan-dev"]["version"] == "1.4.309.0-1"


def _headers(root: Path, version: int, layer_settings: bool = True, spirv: bool = True) -> Path:
    inc = root / "usr" / "include"
    (inc / "vulkan").mkdir(parents=True)
    body = f"#define VK_HEADER_VERSION {version}\n" + ("#define VK_EXT_layer_settings 1\n" if layer_settings else "")
    (inc / "vulkan" / "vulkan_core.h").write_text(body)
    if spirv:
        d = root / "usr" / "share" / "cmake" / "SPIRV-Headers"
        d.mkdir(parents=True)
        (d / "SPIRV-HeadersConfig.cmake").write_text("")
    return inc


def test_header_checks(tmp_path: Path) -> None:
    assert vk.header_version(tmp_path) is None
    assert vk.headers_ok(_headers(tmp_path / "new", 309))
    assert not vk.headers_ok(_headers(tmp_path / "old", 239, layer_settings=False))
    assert vk.header_version(tmp_path / "old" / "usr" / "include") == 0
    assert not vk.headers_ok(_headers(tmp_path / "nospirv", 309, spirv=False))


def test_prefix_override_and_cmake_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inc = _headers(tmp_path / "p", 309)
    monkeypatch.setenv("DGR_VULKAN_PREFIX", str(tmp_path / "p"))
    sdk = vk.find_sdk()
    assert sdk is not None and sdk.source == "DGR_VULKAN_PREFIX" and sdk.header_version == 309
    flags = vk.cmake_flags(sdk)
    assert f"-DVulkan_INCLUDE_DIR={inc}" in flags
    assert any(f.startswith("-DSPIRV-Headers_DIR=") for f in flags)
    monkeypatch.setenv("DGR_VULKAN_PREFIX", str(tmp_path / "missing"))
    assert vk.find_sdk() is None


def test_fetch_refuses_a_deb_whose_hash_differs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The .deb apt leaves must hash to the Packages index's SHA256 (here: a tampered file)."""
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], cwd: Path | None = None) -> str:
        calls.append(cmd)
        if "--print-uris" in cmd:
            return "".join(f"'http://m/{n}_1.0_all.deb' {n}_1.0_all.deb 3 SHA256:{'0' * 64}\n" for n in vk.HEADER_PACKAGES)
        if "download" in cmd:
            for n in vk.HEADER_PACKAGES:
                (cwd / f"{n}_1.0_all.deb").write_bytes(b"bad")
        return ""

    monkeypatch.setattr(vk, "_run", fake_run)
    monkeypatch.setattr(vk, "machine_source", lambda suite: vk.AptSource("http://m/debian", ""))
    monkeypatch.setattr(vk, "base_suite", lambda: "bookworm")
    monkeypatch.setattr(vk.shutil, "which", lambda t: f"/usr/bin/{t}")
    with pytest.raises(DgrError, match="does not match the trixie Packages index"):
        vk.fetch_headers(tmp_path / "sdk")
    assert (tmp_path / "sdk" / "apt" / "sources.list").read_text() == "deb http://m/debian trixie main\n"
    assert not any(c[0] == "dpkg" for c in calls)   # nothing unpacked


def test_missing_system_packages_name_the_exact_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vk.os, "geteuid", lambda: 1000)
    with pytest.raises(DgrError) as e:
        vk.install_system_packages(["glslc", "mesa-vulkan-drivers"])
    assert "apt-get install -y --no-install-recommends glslc mesa-vulkan-drivers" in e.value.one_line()


def test_cublas_from_an_unpacked_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "nvidia" / "cu13"
    (root / "include").mkdir(parents=True)
    (root / "include" / "cublas_v2.h").write_text("")
    (root / "lib").mkdir()
    for n in ("libcublas.so.13", "libcublasLt.so.13"):
        (root / "lib" / n).write_text("")
    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path / "build"))
    (tmp_path / "build" / "cuda-sdk").mkdir(parents=True)
    (tmp_path / "build" / "cuda-sdk" / "sdk.json").write_text(json.dumps({"root": str(root), "version": "13.0.2.14",
                                                                          "sha256": "ab" * 32}))
    blas = cuda_sdk.find_cublas(None)
    assert blas is not None and blas.library.name == "libcublas.so.13" and "13.0.2.14" in blas.source
    flags = cuda_sdk.cmake_flags(blas)
    assert f"-DCUDA_cublas_LIBRARY={root / 'lib' / 'libcublas.so.13'}" in flags
    assert f"-DCMAKE_CUDA_FLAGS=-I{root / 'include'}" in flags


def test_wheel_record_hashes_are_checked(tmp_path: Path) -> None:
    import base64
    import hashlib

    good = base64.urlsafe_b64encode(hashlib.sha256(b"data").digest()).rstrip(b"=").decode()
    whl = tmp_path / "w.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("nvidia/x.h", b"data")
        z.writestr("w.dist-info/RECORD", f"nvidia/x.h,sha256={good},4\nw.dist-info/RECORD,,\n")
    with zipfile.ZipFile(whl) as z:
        cuda_sdk._check_record(z)
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("nvidia/x.h", b"tampered")
        z.writestr("w.dist-info/RECORD", f"nvidia/x.h,sha256={good},4\n")
    with zipfile.ZipFile(whl) as z, pytest.raises(DgrError, match="RECORD"):
        cuda_sdk._check_record(z)


def test_doctor_lists_every_backend_with_install_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vk, "deb_installed", lambda p: None)
    monkeypatch.setattr(vk.shutil, "which", lambda t: None if t == "glslc" else f"/usr/bin/{t}")
    monkeypatch.setattr(vk, "find_sdk", lambda: None)
    monkeypatch.setattr(vk, "loader_library", lambda: None)
    rep = doctor.check("vulkan")
    assert not rep.ready
    names = {i.name: i for i in rep.items}
    assert not names["apt:mesa-vulkan-drivers"].present and not names["glslc"].present
    assert any("apt-get install -y --no-install-recommends glslc libvulkan1 mesa-vulkan-drivers" in c for c in rep.install)
    assert [r.backend for r in map(doctor.check, doctor.BACKENDS)] == list(doctor.BACKENDS)
    with pytest.raises(DgrError, match="unknown backend"):
        doctor.check("opencl")


def test_doctor_cli_json_and_bad_backend() -> None:
    import subprocess

    r = subprocess.run([sys.executable, "-m", "dgr.main", "doctor", "--backend", "cpu", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (cpu,) = json.loads(r.stdout)
    assert cpu["backend"] == "cpu" and {"cmake", "ninja"} <= {i["name"] for i in cpu["items"]}
    r = subprocess.run([sys.executable, "-m", "dgr.main", "doctor", "--backend", "opencl"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().startswith("dgr: error: unknown backend") and "Traceback" not in r.stderr


def test_backend_spec_per_shard() -> None:
    assert rt.parse_backends("vulkan", 2) == ["vulkan", "vulkan"]
    assert rt.parse_backends("cpu, vulkan", 2) == ["cpu", "vulkan"]
    for bad in ("cpu,vulkan,cpu", "opencl", ""):
        with pytest.raises(DgrError):
            rt.parse_backends(bad, 2)
    assert rt.backend_env("vulkan", {}).get("GGML_VK_VISIBLE_DEVICES") in ("0", None)
    assert "GGML_VK_VISIBLE_DEVICES" not in rt.backend_env("cpu", {})


def _tops(tokens, lp=-0.1):
    return [[(t, lp), (t + 1, lp - 2.0)] for t in tokens]


def test_drift_arithmetic() -> None:
    ref = [5, 6, 7, 8]
    same = rd.compare_prompt("p", 3, (ref, _tops(ref)), list(ref), (list(ref), _tops(ref)))
    assert (same.first_divergence, same.greedy_agree, same.top1_agree, same.max_abs_dlogprob) == (None, 4, 4, 0.0)
    # free run diverges at 2; forced top-1 disagrees once; logprob of the reference token moves 0.3
    forced_top = _tops(ref)
    forced_top[1] = [(6, -0.4), (99, -0.5)]
    d = rd.compare_prompt("p", 3, (ref, _tops(ref)), [5, 6, 9, 9], ([5, 6, 7, 9], forced_top))
    assert d.first_divergence == 2 and d.greedy_agree == 2 and d.top1_agree == 3
    assert d.max_abs_dlogprob == pytest.approx(0.3)
    # the reference token falls out of the route's top-k: unbounded
    forced_top[3] = [(1, -0.1)]
    assert math.isinf(rd.compare_prompt("p", 3, (ref, _tops(ref)), ref, (ref, forced_top)).max_abs_dlogprob)
    rep = rd.DriftReport("m", ["0:2", "2:4"], ["cpu", "vulkan"], "cpu+vulkan", "cpu", 4, [same, d])
    assert rep.tokens == 8 and rep.top1_agreement == pytest.approx(7 / 8) and rep.greedy_agreement == pytest.approx(6 / 8)
    assert rep.violations({"tokens": 8, "top1_agreement_min": 0.8, "max_abs_dlogprob": 0.5}) == []
    bad = rep.violations({"tokens": 64, "top1_agreement_min": 0.95, "max_abs_dlogprob": 0.1, "bogus": 1})
    assert len(bad) == 4
    assert json.loads(json.dumps(rep.to_json()))["top1_agreement"] == pytest.approx(7 / 8)


def test_native_x86_builds_leave_amx_out(monkeypatch) -> None:
    """The pinned ggml's AMX path crashes on wide models (docs/realistic-size.md): x86-64 builds
    compile without it, in one CMAKE_C/CXX_FLAGS each even when a backend sets its own."""
    from dgr.upstream import build as b

    monkeypatch.setattr(b.platform, "machine", lambda: "x86_64")
    flags = b._merge_compiler_flags(["-DX=1", "-DCMAKE_CXX_FLAGS=-I/inc"] + b.cpu_isa_flags())
    assert flags == ["-DX=1", f"-DCMAKE_CXX_FLAGS=-I/inc {b.NO_AMX}", f"-DCMAKE_C_FLAGS={b.NO_AMX}"]
    assert f"-DCMAKE_C_FLAGS={b.NO_AMX}" in b.check_toolchain("cpu")
    monkeypatch.setattr(b.platform, "machine", lambda: "aarch64")
    assert b.cpu_isa_flags() == []
