"""Binaries a test needs from the build, with the one rule for when they are missing: a skip
that names the build command, except in CI (CI=true), where CI builds them (``./quickstart.sh
test``: ``dgr build --tests --tools``) and a missing one is a failure, never a silent skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPU_BIN = REPO / "build" / "cpu" / "bin"


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def built(name: str, build: str, bin_dir: Path = CPU_BIN) -> Path:
    """``bin_dir/name`` (default build/cpu/bin). Missing: pytest.fail under CI=true, else
    pytest.skip saying to run ``build`` (e.g. ``dgr build --tools``)."""
    exe = bin_dir / name
    if not exe.is_file():
        why = f"{exe} missing: run `{build}`"
        if in_ci():
            pytest.fail(f"CI=true and {why} (CI builds it: ./quickstart.sh test)")
        pytest.skip(why)
    return exe
