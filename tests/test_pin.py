"""The llama.cpp pin: archive hash, exact commit and clean-tree verification."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gitfixtures import commit_file, fake_checkout, make_upstream  # noqa: E402

from dgr.upstream import pin as pin_mod  # noqa: E402
from dgr.errors import DgrError  # noqa: E402


def test_pin_file_records_the_exact_commit_and_source():
    p = pin_mod.load_pin()
    assert p.commit == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert p.sdist.package == "llama-cpp-python" and p.sdist.version == "0.3.36"
    assert p.sdist.sha256 == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert p.sdist.path == "vendor/llama.cpp"
    assert p.date.startswith("2026-10-01")


def _fake_archive(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        data = b"not llama.cpp\n"
        info = tarfile.TarInfo("llama_cpp_python-0.3.36/vendor/llama.cpp/README.md")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_tampered_archive_is_rejected(tmp_path):
    archive = _fake_archive(tmp_path / "llama_cpp_python-0.3.36.tar.gz")
    with pytest.raises(DgrError, match="has sha256 .* but the pin says 832db069"):
        pin_mod.fetch(tmp_path / "cache", archive=archive)
    assert not (tmp_path / "cache" / "verified.json").exists()


def test_tampered_archive_cli_one_line(tmp_path):
    archive = _fake_archive(tmp_path / "llama_cpp_python-0.3.36.tar.gz")
    proc = subprocess.run([sys.executable, "-m", "dgr.main", "pin", "fetch", "--archive", str(archive),
                           "--cache", str(tmp_path / "cache")], capture_output=True, text=True)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("dgr: error: archive ") and "sha256" in lines[-1]
    assert "Traceback" not in proc.stderr


def test_verify_tree_wrong_commit_and_dirty(tmp_path):
    up = tmp_path / "src"
    base = make_upstream(up, {"a.txt": "a\n", "LICENSE": "MIT\n"})
    pin = pin_mod.load_pin()
    fake = pin_mod.Pin(pin.name, pin.repository, base, pin.date, pin.subject, pin.sdist, ("LICENSE",))
    assert pin_mod.verify_tree(up, fake) == base
    with pytest.raises(DgrError, match=f"HEAD is {base}, but the pin says {pin.commit}"):
        pin_mod.verify_tree(up, pin)
    (up / "a.txt").write_text("changed\n")
    with pytest.raises(DgrError, match="is dirty: 1 changed path"):
        pin_mod.verify_tree(up, fake)
    (up / "a.txt").write_text("a\n")
    (up / "extra.c").write_text("x")
    with pytest.raises(DgrError, match="is dirty"):
        pin_mod.verify_tree(up, fake)


def test_pin_verify_cli_dirty_tree_one_line(tmp_path):
    up = tmp_path / "src"
    base = make_upstream(up, {"a.txt": "a\n", "LICENSE": "MIT\n"})
    env = fake_checkout(tmp_path / "checkout", up, base)
    ok = subprocess.run([sys.executable, "-m", "dgr.main", "pin", "verify"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    (up / "a.txt").write_text("tampered\n")
    bad = subprocess.run([sys.executable, "-m", "dgr.main", "pin", "verify"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("dgr: error: pinned source tree at ")
    # A moved HEAD is named too.
    commit_file(up, "a.txt", "moved\n", "move")
    bad = subprocess.run([sys.executable, "-m", "dgr.main", "pin", "verify"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and f"but the pin says {base}" in bad.stderr


def test_version_prints_pin_and_series_digest():
    proc = subprocess.run([sys.executable, "-m", "dgr.main", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "0c1e57098bba43ac29e6e3b677cdceebdd22334f" in proc.stdout
    assert "patch series sha256:" in proc.stdout


def test_help_lists_command_groups():
    proc = subprocess.run([sys.executable, "-m", "dgr.main", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for group in ("pin", "patches", "build", "accept"):
        assert group in proc.stdout
