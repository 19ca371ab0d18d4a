"""The GPU check for a lent machine: the bundle (`dgr build --bundle`) and tools/gpu-check.sh.

The fast tests check the pieces without building anything. The dry run (real-model lane, which
CI runs with MESHNET_ENABLE_REAL_INFERENCE_TESTS=1) builds or reuses the CPU bundle
(build/bundle-cpu from the shared tree build/gpu-bundle-cpu: minutes from cold, seconds once
built), checks that it travels, and runs every step of the script on it with tiny models.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "gpu-check.sh"
# every step the script records, in order; the large-model steps run on a second tiny model here
STEPS = ("preflight", "device", "synth-small", "parity-2", "parity-3", "drift-mixed", "worker-bench", "prefill",
         "route-b8", "certify", "vulkan", "synth-large", "worker-bench-large", "prefill-large", "route-b8-large")


def _step(tmp: Path, name: str, **doc) -> None:
    (tmp / f"{name}.json").write_text(json.dumps({"step": name, **doc}))


def test_report_counts_steps_and_names_missing_ones(tmp_path: Path, monkeypatch):
    from dgr.bench import gpu_check

    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path / "no-bundle"))
    _step(tmp_path, "a", status="pass", kind="cli")
    _step(tmp_path, "b", status="measured", kind="prefill",
          result={"n_prompt": 8, "worker_tok_s": 10.0, "llama_bench_pp_tok_s": 11.0, "ratio": 10 / 11})
    _step(tmp_path, "c", status="skipped", reason="why")
    out = tmp_path / "doc.json"
    assert gpu_check.main(["report", "--steps", str(tmp_path), "--out", str(out), "--backend", "cpu",
                           "--order", "a,b,c,d"]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "dgr.gpu-check/1" and doc["mode"] == "cpu-dry-run" and doc["targets_judged"] is False
    assert [s["step"] for s in doc["steps"]][:4] == ["a", "b", "c", "d"]
    assert doc["steps"][3]["status"] == "error" and "no result" in doc["steps"][3]["reason"]
    assert doc["summary"]["pass"] == 1 and doc["summary"]["measured"] == 1 and doc["summary"]["skipped"] == 1
    assert doc["summary"]["verdict"] == "incomplete"


def test_a_step_that_wrote_nothing_is_recorded_from_its_exit(tmp_path: Path):
    from dgr.bench import gpu_check

    out = tmp_path / "s.json"
    gpu_check.main(["fallback", "--step-id", "slow", "--out", str(out), "--exit", "124", "--limit", "30"])
    doc = json.loads(out.read_text())
    assert doc["status"] == "error" and "deadline (30 s)" in doc["reason"]


def test_targets_are_judged_on_an_accelerator_only():
    from dgr.bench import gpu_check

    assert gpu_check._status(True, "cuda") == "pass" and gpu_check._status(False, "cuda") == "fail"
    assert gpu_check._status(False, "cpu") == "measured"
    assert gpu_check.TARGETS["worker_vs_llama_batched_bench"]["min_ratio"] == 0.95
    assert gpu_check.TARGETS["route_vs_whole"]["min_ratio"] == 0.9


def test_nothing_is_built_inside_a_bundle(tmp_path: Path, monkeypatch):
    from dgr.errors import DgrError
    from dgr.upstream import build

    (tmp_path / build.BUNDLE_MANIFEST).write_text("{}")
    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path))
    with pytest.raises(DgrError, match="prebuilt bundle"):
        build.build("cpu")
    # a program is only located there, never (re)built
    with pytest.raises(DgrError, match="not built"):
        build.tool_binary("llama-bench", "cpu")


def test_the_bundle_goes_to_an_ignored_folder_of_the_checkout(tmp_path: Path):
    from dgr.errors import DgrError
    from dgr.upstream import bundle

    with pytest.raises(DgrError, match="outside the checkout"):
        bundle._check_out_dir(tmp_path / "b")
    with pytest.raises(DgrError, match="not ignored"):
        bundle._check_out_dir(REPO / "docs" / "bundle-here")
    bundle._check_out_dir(REPO / "build" / "bundle-test-never-made")   # ignored, absent: fine


def test_the_tree_that_travels_leaves_room_for_a_bundle():
    from dgr.upstream import bundle

    tree = bundle.travelling_tree_bytes()
    assert 0 < tree < bundle.TRAVEL_LIMIT_BYTES - bundle.DEFAULT_MARGIN_BYTES - 30 * bundle.MiB


def test_a_bundle_holds_cpu_first_and_vulkan_on_request():
    from dgr.errors import DgrError
    from dgr.upstream import bundle

    assert bundle.bundle_backends("cuda") == ["cpu", "cuda"]
    assert bundle.bundle_backends("cuda", vulkan=True) == ["cpu", "cuda", "vulkan"]
    assert bundle.bundle_backends("vulkan") == bundle.bundle_backends("cpu", vulkan=True) == ["cpu", "vulkan"]
    assert bundle.bundle_backends("cpu") == ["cpu"]
    with pytest.raises(DgrError, match="not 'hip'"):
        bundle.bundle_backends("hip")
    # the Vulkan loader stays a machine library: never copied into the archive, named under needs
    assert bundle.MACHINE_LIBS.match("libvulkan.so.1") and bundle.PER_BACKEND_LIBS.match("libggml-vulkan.so")
    assert bundle.LOADER_DEBS[0] == "libvulkan1"


def _deb(path: Path, package: str, files: dict[str, bytes], links: dict[str, str] = {}) -> Path:
    """A minimal .deb (ar: debian-binary, control.tar.xz, data.tar.xz), as apt-get download writes."""
    import io
    import tarfile

    def tar(entries: dict[str, bytes], symlinks: dict[str, str] = {}) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tf:
            for name, data in entries.items():
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            for name, target in symlinks.items():
                ti = tarfile.TarInfo(name)
                ti.type, ti.linkname = tarfile.SYMTYPE, target
                tf.addfile(ti)
        return buf.getvalue()

    control = f"Package: {package}\nVersion: 1.3.239.0-1\nArchitecture: amd64\nDepends: libc6 (>= 2.34)\n" \
              f"Description: test\n two lines\n".encode()
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", tar({"./control": control})),
               ("data.tar.xz", tar(files, links))]
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    path.write_bytes(out)
    return path


def test_a_loader_deb_is_read_and_unpacked_without_dpkg(tmp_path: Path):
    from dgr.upstream import bundle

    lib = "./usr/lib/x86_64-linux-gnu/"
    deb = _deb(tmp_path / "libvulkan1_1.3.239.0-1_amd64.deb", "libvulkan1",
               {lib + "libvulkan.so.1.3.239": b"\x7fELF-not-really", "./usr/share/doc/libvulkan1/copyright": b"x"},
               {lib + "libvulkan.so.1": "libvulkan.so.1.3.239"})
    f = bundle.deb_fields(deb)
    assert f["Package"] == "libvulkan1" and f["Version"] == "1.3.239.0-1" and f["Depends"] == "libc6 (>= 2.34)"
    assert bundle.deb_libraries(deb) == ["libvulkan.so.1", "libvulkan.so.1.3.239"]
    dest = tmp_path / "gl"
    bundle.unpack_deb(deb, dest)   # what tools/gpu-check.sh does without dpkg: under dest, never over /
    assert (dest / "usr/lib/x86_64-linux-gnu/libvulkan.so.1").read_bytes() == b"\x7fELF-not-really"
    with pytest.raises(Exception, match="not an ar archive"):
        bundle.deb_fields(tmp_path / "gl" / "usr/share/doc/libvulkan1/copyright")


def test_the_loader_debs_are_listed_with_their_hashes(tmp_path: Path, monkeypatch):
    """fetch_debs copies the cached .debs (build/gpu-bundle-debs; apt-get download only for a
    missing one) into the bundle's debs/ and lists each with its version, libraries and sha256."""
    from dgr.upstream import bundle

    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path / "build"))
    cache = bundle.deb_cache_dir()
    cache.mkdir(parents=True)
    _deb(cache / "libvulkan1_1.3.239.0-1_amd64.deb", "libvulkan1",
         {"./usr/lib/x86_64-linux-gnu/libvulkan.so.1.3.239": b"v"})
    _deb(cache / "libglvnd0_1.3.239.0-1_amd64.deb", "libglvnd0",
         {"./usr/lib/x86_64-linux-gnu/libGLdispatch.so.0.0.0": b"g"})
    monkeypatch.setattr(bundle.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}: nothing to download"))
    rows = bundle.fetch_debs(tmp_path / "out" / "debs", ("libvulkan1", "libglvnd0"))
    assert [r["package"] for r in rows] == ["libvulkan1", "libglvnd0"]
    assert rows[0]["file"] == "debs/libvulkan1_1.3.239.0-1_amd64.deb" and rows[0]["version"] == "1.3.239.0-1"
    assert rows[0]["libraries"] == ["libvulkan.so.1.3.239"] and rows[1]["libraries"] == ["libGLdispatch.so.0.0.0"]
    for r in rows:
        copied = tmp_path / "out" / r["file"]
        assert r["sha256"] == bundle.sha256_file(copied) and r["bytes"] == copied.stat().st_size


def test_the_summary_names_the_vulkan_build_and_the_debs():
    from dgr.upstream import bundle

    doc = {"backend": "cuda", "backends": ["cpu", "cuda", "vulkan"], "cuda_architectures": "90-real",
           "files": {"vulkan/bin/libggml-vulkan.so.0": {"bytes": 3 << 20}, "lib/libllama.so.0": {"bytes": 1 << 20}},
           "unpacked_bytes": 4 << 20, "archive": {"file": "bundle.tar.xz", "bytes": 1 << 20, "xz_preset": 6, "seconds": 1},
           "wheels": [], "debs": [{"bytes": 200_000}, {"bytes": 100_000}], "bundle_bytes": 2 << 20,
           "tree_bytes": 6 << 20, "travel_bytes": 8 << 20, "limit_bytes": 64 << 20, "margin_bytes": 8 << 20,
           "needs": {"machine_libraries": ["libcuda.so.1", "libvulkan.so.1"], "symbol_versions": {}}}
    text = bundle.summary(doc)
    assert "bundle cuda (cpu, cuda, vulkan)" in text and "vulkan/bin" in text
    assert "+ debs 0.29 MiB (2: the Vulkan loader" in text and "libvulkan.so.1" in text


def test_the_dry_run_measures_its_vulkan_steps_and_the_gpu_run_judges_them(monkeypatch):
    from dgr.bench import gpu_check

    monkeypatch.delenv("DGR_GPU_CHECK_DRY_RUN", raising=False)
    assert gpu_check._status(False, "vulkan") == "fail" and gpu_check.TARGETS["vulkan"]["device_class"] == "vulkan:nvidia"
    monkeypatch.setenv("DGR_GPU_CHECK_DRY_RUN", "1")   # tools/gpu-check.sh --dry-run-cpu: llvmpipe
    assert gpu_check._status(False, "vulkan") == "measured"
    assert gpu_check._headline({"kind": "vulkan-device", "result": {"device": {
        "device_class": "vulkan:nvidia", "description": "NVIDIA H100 80GB HBM3"}}}) == "vulkan:nvidia: NVIDIA H100 80GB HBM3"


def test_the_script_parses_and_says_how_to_run_it():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    assert "--dry-run-cpu" in out and "build/bundle-cuda" in out and "--no-vulkan" in out


@pytest.mark.real
def test_cpu_dry_run_runs_every_step(tmp_path: Path, monkeypatch):
    """The CPU bundle builds (or is up to date), travels with the tree, and the script's dry run
    records every step with its numbers in one JSON document."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "cli")}
    bundle_dir = REPO / "build" / "bundle-cpu"
    r = subprocess.run([sys.executable, "-m", "dgr.main", "build", "--bundle", str(bundle_dir), "--backend", "cpu",
                        "--no-wheels", "-j", "2"], capture_output=True, text=True, env=env, timeout=3600)
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((bundle_dir / "dgr-bundle.json").read_text())
    assert manifest["kind"] == "dgr.bundle/1" and manifest["fits"]
    assert manifest["travel_bytes"] <= manifest["limit_bytes"] - manifest["margin_bytes"]
    # what is carried: the xz archive (about 9 MiB for the CPU build), no wheels here
    assert manifest["bundle_bytes"] < 16 * (1 << 20) and manifest["archive"]["bytes"] < manifest["unpacked_bytes"]
    names = set(manifest["files"])
    for prog in ("dgr-worker", "llama-bench", "llama-batched-bench"):
        assert f"cpu/bin/{prog}" in names
    # one libggml and one libllama that every program loads; the backend registry per backend
    assert {"lib/libggml-base.so.0", "lib/libllama.so.0", "cpu/bin/libggml.so.0"} <= names
    assert any(n.startswith("lib/libgrpc++.so") for n in names)

    # a bundle that would not travel is refused and removed (the archive stood in for: 60 MiB)
    from dgr.errors import DgrError
    from dgr.upstream import bundle

    refused = REPO / "build" / "bundle-test-refused"
    monkeypatch.setattr(bundle, "_pack", lambda stage, archive: archive.write_bytes(b"\0" * (60 << 20)))
    with pytest.raises(DgrError, match="over the 64 MiB limit"):
        bundle.make_bundle(refused, "cpu", build=False, wheels=False)
    assert not refused.exists()

    out, work = tmp_path / "out", tmp_path / "work"
    env = {**env, "OUT": str(out), "GPU_CHECK_WORK": str(work), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run-cpu", "--bundle", str(bundle_dir)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads((out / "gpu-check.json").read_text())
    assert (out / "gpu-check.log").is_file()
    steps = {s["step"]: s for s in doc["steps"]}
    assert doc["kind"] == "dgr.gpu-check/1" and doc["mode"] == "cpu-dry-run"
    assert list(steps) == list(STEPS), list(steps)
    bad = {k: (s["status"], s.get("reason")) for k, s in steps.items()
           if s["status"] not in ("pass", "measured") and k != "vulkan"}
    assert not bad, bad
    assert steps["vulkan"]["status"] == "skipped" and steps["vulkan"]["reason"]
    for name in ("parity-2", "parity-3"):
        assert steps[name]["result"]["parity"]["ok"] and steps[name]["result"]["parity"]["compared_tokens"] > 0
    assert steps["drift-mixed"]["result"]
    for name in ("worker-bench", "worker-bench-large"):
        levels = steps[name]["result"]["levels"]
        assert [lv["sessions"] for lv in levels] == [1, 8, 32]
        assert all(lv["worker_tok_s"] > 0 and lv["llama_batched_bench_tok_s"] > 0 for lv in levels)
    for name in ("prefill", "prefill-large"):
        res = steps[name]["result"]
        assert res["worker_tok_s"] > 0 and res["llama_bench_pp_tok_s"] > 0 and res["ratio"] > 0
    for name in ("route-b8", "route-b8-large"):
        res = steps[name]["result"]
        assert res["identical_tokens"] and res["ratio"] > 0 and res["tokens_compared"] > 0
        assert len(res["memory"]) == 3   # the whole-model worker and the two shards
        assert all(m["predicted_bytes"] and m["measured_bytes"] for m in res["memory"])
    cert = steps["certify"]["result"]
    assert cert["verdict"] == "pass" and cert["plan"] == "cpu" and cert["device_classes"] == ["cpu"]
    assert cert["identical"] == [True, True] and cert["evidence"]["runs"]
    assert doc["summary"]["verdict"] == "pass" and doc["summary"]["error"] == 0
