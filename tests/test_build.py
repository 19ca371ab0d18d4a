"""Build driver: toolchain checks (no build needed) and the built worker's identity (native)."""

from __future__ import annotations

import subprocess

from pathlib import Path

import pytest
from pathlib import Path

from dgr.upstream import build as build_mod
from dgr.upstream import patchstack
from dgr.upstream import pin as pin_mod
from dgr.errors import DgrError


def test_unknown_backend_is_refused():
    with pytest.raises(DgrError, match="unknown backend 'opencl'"):
        build_mod.check_toolchain("opencl")


def test_missing_toolchains_are_named(monkeypatch):
    real_which = build_mod.shutil.which
    monkeypatch.setattr(build_mod.shutil, "which", lambda name: None if name in ("nvcc", "hipcc", "glslc") else real_which(name))
    monkeypatch.setattr(build_mod.Path, "exists", lambda self: False)
    with pytest.raises(DgrError, match="backend cuda needs the CUDA toolkit"):
        build_mod.check_toolchain("cuda")
    with pytest.raises(DgrError, match="backend hip needs ROCm"):
        build_mod.check_toolchain("hip")


def test_old_vulkan_headers_are_explained(tmp_path, monkeypatch):
    from dgr.upstream import vulkan_sdk

    inc = tmp_path / "usr/include/vulkan"
    inc.mkdir(parents=True)
    (inc / "vulkan_core.h").write_text("#define VK_HEADER_VERSION 239\n")
    monkeypatch.setenv("DGR_VULKAN_PREFIX", str(tmp_path))
    # the system side is present (no apt from a unit test); only the prefix's headers are old
    monkeypatch.setattr(vulkan_sdk, "missing_system_packages", lambda: [])
    monkeypatch.setattr(vulkan_sdk, "loader_library", lambda: Path("/usr/lib/libvulkan.so.1"))
    monkeypatch.setattr(vulkan_sdk.shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(DgrError) as exc:
        build_mod.check_toolchain("vulkan")
    msg = str(exc.value)
    assert "VK_HEADER_VERSION 239" in msg and "VK_EXT_layer_settings" in msg
    # no glslc: one line with the exact install command
    monkeypatch.setattr(vulkan_sdk.shutil, "which", lambda name: None if name == "glslc" else "/usr/bin/" + name)
    with pytest.raises(DgrError) as exc:
        build_mod.check_toolchain("vulkan")
    assert "glslc" in exc.value.one_line() and "apt-get install -y --no-install-recommends glslc" in exc.value.one_line()


def test_metal_only_on_macos(monkeypatch):
    monkeypatch.setattr(build_mod.platform, "system", lambda: "Linux")
    with pytest.raises(DgrError, match="metal builds only on macOS"):
        build_mod.check_toolchain("metal")


@pytest.mark.native
def test_built_worker_reports_pin_digest_and_backend(native_bin):
    out = subprocess.run([str(native_bin / "dgr-worker"), "--version"], capture_output=True, text=True, check=True).stdout
    assert pin_mod.load_pin().commit in out
    assert patchstack.default_stack().series_digest() in out
    assert "backend cpu" in out
    assert (native_bin / "llama.cpp-LICENSE").is_file() and (native_bin / "llama.cpp-AUTHORS").is_file()
    smoke = subprocess.run([str(native_bin / "dgr-worker"), "--smoke"], capture_output=True, text=True)
    assert smoke.returncode == 0 and "smoke: ok" in smoke.stdout
    bad = subprocess.run([str(native_bin / "dgr-worker"), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument" in bad.stderr


def test_sanitize_builds_in_its_own_tree_with_the_sanitizer_option(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(build_mod.paths, "build_dir", lambda: tmp_path)  # its own lock files

    def fake_locked(backend, flags, bdir, **kw):
        seen.update(backend=backend, bdir=bdir, **kw)
        return build_mod.BuildResult(backend, bdir, bdir / "bin", kw["targets"])

    monkeypatch.setattr(build_mod, "check_toolchain", lambda backend: [])
    monkeypatch.setattr(build_mod, "_build_locked", fake_locked)
    res = build_mod.build("cpu", targets=("dgr-tests",), sanitize=True)
    assert res.build_dir == build_mod.sanitize_build_dir("cpu") and res.build_dir.name == "cpu-asan"
    assert "-DDGR_SANITIZE=ON" in seen["extra_cmake"]
    build_mod.build("cpu", targets=("dgr-worker",))
    assert seen["bdir"].name == "cpu" and "-DDGR_SANITIZE=ON" not in seen["extra_cmake"]
