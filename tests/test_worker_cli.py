"""`dgr worker serve` maps its options onto dgr-worker and runs it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dgr.main import app
from dgr.protocol.client import WorkerClient


def test_serve_dry_run_maps_flags():
    r = CliRunner().invoke(app, ["worker", "serve", "--fake-model", "--layers", "2:6", "--max-sessions", "4",
                                 "--kv-cells", "128", "--queue-limit", "8", "--metrics-listen", "127.0.0.1:0",
                                 "--dry-run"])
    assert r.exit_code == 0, r.output
    argv = r.output.split()
    assert argv[0].endswith("bin/dgr-worker") and argv[1] == "serve"
    for flag, value in (("--layers", "2:6"), ("--max-sessions", "4"), ("--kv-cells", "128"),
                        ("--queue-limit", "8")):
        assert argv[argv.index(flag) + 1] == value
    assert "--fake-model" in argv
    assert "--listen" not in argv and "--ctx-per-session" not in argv  # left out: the worker's defaults hold


def test_serve_needs_one_model_source():
    r = CliRunner().invoke(app, ["worker", "serve"])
    assert r.exit_code != 0


@pytest.mark.native
def test_serve_runs_the_worker(native_bin: Path, tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-m", "dgr.main", "worker", "serve", "--fake-model",
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline().decode()
        assert "listening on 127.0.0.1:" in line, line + proc.stderr.read().decode()
        port = int(line.rsplit(":", 1)[1])
        with WorkerClient(f"127.0.0.1:{port}") as c:
            assert c.wait_ready(20).identity.architecture == "fake"
        proc.terminate()
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.native
def test_non_loopback_refused_without_tls(native_bin: Path):
    r = subprocess.run([str(native_bin / "dgr-worker"), "serve", "--fake-model", "--listen", "0.0.0.0:0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "non-loopback" in r.stderr
