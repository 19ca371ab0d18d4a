"""Throwaway git repositories and fake dgr checkouts for patch-stack and pin tests."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

IDENT = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *IDENT, *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


def make_upstream(path: Path, files: dict[str, str]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "master")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "upstream base")
    return git(path, "rev-parse", "HEAD")


def commit_file(repo: Path, name: str, text: str, message: str) -> str:
    (repo / name).write_text(text)
    git(repo, "add", name)
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


LINES = "".join(f"line {i}\n" for i in range(1, 41))
PATCH_BODY = "Why: tests.\nUpstreamable: no.\nForwarded: no\n"


def fake_checkout(root: Path, upstream: Path, commit: str) -> dict[str, str]:
    """A dgr 'repository root' whose pin names ``commit`` of ``upstream`` and a pin cache that
    points at it; returns the environment that makes the CLI use them."""
    (root / "upstream" / "patches").mkdir(parents=True, exist_ok=True)
    (root / "upstream" / "llama.cpp.pin").write_text(f"""schema = 1
[upstream]
name = "fake"
repository = "{upstream}"
commit = "{commit}"
date = "2026-01-01T00:00:00Z"
[source.sdist]
package = "none"
version = "0"
filename = "none.tar.gz"
sha256 = "{'0' * 64}"
root = "none"
path = "none"
gitdir = "none"
[notices]
files = ["LICENSE"]
""")
    (root / "upstream" / "patches" / "series").write_text("")
    (root / "upstream" / "assumptions.toml").write_text(f'base = "{commit}"\n')
    cache = root / "pincache"
    cache.mkdir(exist_ok=True)
    (cache / "verified.json").write_text(json.dumps({"commit": commit, "path": str(upstream)}))
    env = dict(os.environ)
    env.update(DGR_REPO_ROOT=str(root), DGR_PIN_CACHE=str(cache), DGR_BUILD_DIR=str(root / "build"))
    return env
