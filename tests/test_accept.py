"""`dgr accept`: options after the story id, --all, the evidence/README.md index, and the git
commit + dirty flag every run records (synthetic stories registered by the test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dgr.accept import evidence
from dgr.main import app

from gitfixtures import git


@pytest.fixture
def stories(monkeypatch):
    """Two synthetic stories instead of the registered ones (one passes, one fails)."""
    evidence._load_stories()
    reg: dict[str, evidence.Story] = {}
    monkeypatch.setattr(evidence, "_REGISTRY", reg)
    monkeypatch.setattr(evidence, "_load_stories", lambda: None)

    def ok(ctx):
        ctx.results["n"] = 1
        ctx.check("it works", True, "yes")

    def bad(ctx):
        ctx.check("it works", False, "no")

    def locked(ctx):
        ctx.check("never run by --all", True)

    reg["T-001"] = evidence.Story("T-001", "passes", "synthetic", ok, False)
    reg["T-002"] = evidence.Story("T-002", "fails | with a pipe", "synthetic", bad, False)
    reg["T-003"] = evidence.Story("T-003", "locked", "synthetic", locked, False, in_all=False,
                                  all_note="holds a locked contract")
    return reg


def test_options_after_the_story_id(stories, tmp_path):
    r = CliRunner().invoke(app, ["accept", "T-001", "--out", str(tmp_path), "--backend", "cpu"])
    assert r.exit_code == 0, r.output
    assert "T-001: PASS" in r.output and (tmp_path / "T-001" / "results.json").is_file()
    r = CliRunner().invoke(app, ["accept", "t-002", "--out", str(tmp_path)])
    assert r.exit_code == 1 and "T-002: FAIL" in r.output


def test_bad_invocations_are_one_line_errors(stories, tmp_path):
    for args in (["accept"], ["accept", "T-001", "--all"], ["accept", "NOPE-1", "--out", str(tmp_path)]):
        p = subprocess.run([sys.executable, "-m", "dgr.main", *args], capture_output=True, text=True)
        # NOPE-1 goes through the real registry (a subprocess does not see the fixture)
        assert p.returncode != 0 and "Traceback" not in p.stderr
        assert p.stderr.strip().startswith("dgr: error:") and len(p.stderr.strip().splitlines()) == 1


def test_all_runs_every_story_but_the_locked_ones_and_writes_the_index(stories, tmp_path):
    r = CliRunner().invoke(app, ["accept", "--all", "--out", str(tmp_path)])
    assert r.exit_code == 1                                     # T-002 fails
    assert "skipping T-003: holds a locked contract" in r.output
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["T-001", "T-002"]
    index = (tmp_path / "README.md").read_text()
    rows = [ln for ln in index.splitlines() if ln.startswith("| [T-")]
    assert len(rows) == 2
    assert "| PASS | synthetic |" in rows[0] and "| FAIL | synthetic |" in rows[1]
    assert "fails \\| with a pipe" in rows[1]
    env = json.loads((tmp_path / "T-001" / "environment.json").read_text())
    assert env["git_commit"] and env["git_commit"][:12] in rows[0]


def test_git_state_flags_changes_outside_evidence(tmp_path):
    repo = tmp_path / "r"
    (repo / "evidence" / "X").mkdir(parents=True)
    (repo / "code.py").write_text("a = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    head = git(repo, "rev-parse", "HEAD")
    assert evidence.git_state(repo) == {"git_commit": head, "git_dirty": False, "git_dirty_paths": []}
    (repo / "evidence" / "X" / "results.json").write_text("{}")      # the run's own output
    assert evidence.git_state(repo)["git_dirty"] is False
    (repo / "code.py").write_text("a = 2\n")
    st = evidence.git_state(repo)
    assert st["git_dirty"] is True and st["git_dirty_paths"] == ["code.py"]


def test_dirty_evidence_is_labelled(stories, tmp_path, monkeypatch):
    monkeypatch.setattr(evidence, "git_state", lambda *a, **k: {"git_commit": "f" * 40, "git_dirty": True,
                                                                "git_dirty_paths": ["cli/x.py"]})
    ok, out = evidence.run_story("T-001", tmp_path)
    readme = (out / "README.md").read_text()
    assert ok and "**Dirty tree**" in readme and "cli/x.py" in readme
    assert "ffffffffffff (dirty)" in (tmp_path / "README.md").read_text()
