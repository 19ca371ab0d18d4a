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


def test_a_story_that_ends_in_a_decision_has_it_as_its_verdict(stories, tmp_path):
    def gate(ctx):
        ctx.check("the gate ran", True)
        ctx.decide("optimize", "the gate's decision")

    def broken_gate(ctx):
        ctx.check("the gate ran", False, "a route failed")
        ctx.decide("PROMOTE")

    stories["T-004"] = evidence.Story("T-004", "gate", "synthetic", gate, False)
    stories["T-005"] = evidence.Story("T-005", "broken gate", "synthetic", broken_gate, False)
    r = CliRunner().invoke(app, ["accept", "T-004", "--out", str(tmp_path)])
    assert r.exit_code == 0 and "T-004: OPTIMIZE (the run held)" in r.output, r.output
    readme = (tmp_path / "T-004" / "README.md").read_text()
    assert "**Verdict: OPTIMIZE**" in readme and "The run held: yes, 1 of 1 criteria met" in readme
    assert "Verdict: PASS" not in readme
    res = json.loads((tmp_path / "T-004" / "results.json").read_text())
    assert (res["verdict"], res["criteria_met"], res["decision"]) == ("optimize", True, "OPTIMIZE")
    assert "| OPTIMIZE | synthetic |" in (tmp_path / "README.md").read_text()
    # a run that did not hold decides nothing: FAIL, whatever it had reached
    r = CliRunner().invoke(app, ["accept", "T-005", "--out", str(tmp_path)])
    assert r.exit_code == 1 and "T-005: FAIL" in r.output
    readme = (tmp_path / "T-005" / "README.md").read_text()
    assert "**Verdict: FAIL**" in readme and "it had reached PROMOTE" in readme
    with pytest.raises(ValueError):
        evidence.StoryContext("T", tmp_path, tmp_path, "synthetic").decide("SHIP")


def test_freshness_follows_the_files_a_story_covers(stories, tmp_path, monkeypatch):
    repo = tmp_path / "r"
    (repo / "code").mkdir(parents=True)
    (repo / "code" / "a.py").write_text("a = 1\n")
    (repo / "docs.md").write_text("x\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD")
    stories.clear()
    for sid in ("T-001", "T-002", "T-003", "T-004"):
        stories[sid] = evidence.Story(sid, sid, "synthetic", lambda ctx: None, False, covers=("code",),
                                      in_all=sid != "T-004", all_note="locked contract")
    stories["T-006"] = evidence.Story("T-006", "never ran", "synthetic", lambda ctx: None, False, covers=("code",))
    out = repo / "evidence"

    def ran(sid, commit, dirty=False):
        (out / sid).mkdir(parents=True, exist_ok=True)
        (out / sid / "results.json").write_text(json.dumps({"story": sid, "verdict": "pass"}))
        (out / sid / "environment.json").write_text(json.dumps({"git_commit": commit, "git_dirty": dirty}))

    ran("T-001", base)
    ran("T-002", base, dirty=True)
    ran("T-003", "0" * 40)
    ran("T-004", base)

    def states():
        return {f.story: f.state for f in evidence.freshness(out, repo)}

    assert states() == {"T-001": "fresh", "T-002": "stale", "T-003": "stale", "T-004": "locked",
                        "T-006": "missing"}
    (repo / "docs.md").write_text("y\n")                       # not covered: still fresh
    git(repo, "commit", "-qam", "docs")
    assert states()["T-001"] == "fresh"
    (repo / "code" / "a.py").write_text("a = 2\n")             # covered: stale, and says which file
    git(repo, "commit", "-qam", "code")
    f = {f.story: f for f in evidence.freshness(out, repo)}["T-001"]
    assert f.state == "stale" and f.changed == ["code/a.py"] and base[:12] in f.reason
    monkeypatch.setattr(evidence.paths, "repo_root", lambda: repo)
    r = CliRunner().invoke(app, ["accept", "--stale", "--out", str(out)])
    assert r.exit_code == 1 and "T-001: stale" in r.output and "T-006: missing" in r.output, r.output
    index = evidence.write_index(out).read_text()
    assert "| stale: 1 covered file(s) changed" in index and "Registered stories with no evidence yet: T-006" in index


def test_a_story_runs_on_its_own_backend_unless_one_is_named(stories, tmp_path, monkeypatch):
    seen = []
    stories.clear()
    stories["T-007"] = evidence.Story("T-007", "vulkan story", "synthetic",
                                      lambda ctx: (seen.append(ctx.backend), ctx.check("ran", True)), False,
                                      backend="vulkan")
    stories["T-008"] = evidence.Story("T-008", "cpu story", "synthetic",
                                      lambda ctx: (seen.append(ctx.backend), ctx.check("ran", True)), False)
    monkeypatch.setattr(evidence, "environment_manifest", lambda backend, model, git, **_: {
        "timestamp_utc": "t", "host": "h", "cpu": "c", "cpu_count": 1, "backend": backend, "pin_commit": "p",
        "patch_series_digest": "d", "dgr_version": "0", **git})
    evidence.run_all(tmp_path)
    assert seen == ["vulkan", "cpu"]
    evidence.run_all(tmp_path, backend="cpu")
    assert seen[2:] == ["cpu", "cpu"]
    r = CliRunner().invoke(app, ["accept", "--list"])
    assert "T-007  [synthetic] (runs on vulkan)  vulkan story" in r.output


def test_the_derived_render_neither_stales_nor_dirties_and_all_renders_it_first(stories, tmp_path, monkeypatch):
    """upstream/outreach/rendered is written from the evidence (`dgr upstream render`): a change there
    is neither a covered change nor a dirty tree, and `--all` runs a story's prep step before it."""
    repo = tmp_path / "r"
    derived = repo / "upstream" / "outreach" / "rendered"
    derived.mkdir(parents=True)
    (derived / "proposal.md").write_text("RSS 86.3 MiB\n")
    (repo / "upstream" / "patch.txt").write_text("p1\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD")
    (derived / "proposal.md").write_text("RSS 85.9 MiB\n")                 # re-rendered, not committed
    assert evidence.git_state(repo)["git_dirty"] is False
    stories.clear()
    stories["T-001"] = evidence.Story("T-001", "t", "synthetic", lambda ctx: None, False, covers=("upstream",))
    out = repo / "evidence"
    (out / "T-001").mkdir(parents=True)
    (out / "T-001" / "results.json").write_text(json.dumps({"story": "T-001", "verdict": "pass"}))
    (out / "T-001" / "environment.json").write_text(json.dumps({"git_commit": base, "git_dirty": False}))
    git(repo, "commit", "-qam", "render")
    assert [f.state for f in evidence.freshness(out, repo)] == ["fresh"]
    (repo / "upstream" / "patch.txt").write_text("p2\n")                   # the rest of upstream/ is covered
    git(repo, "commit", "-qam", "patch")
    assert [f.state for f in evidence.freshness(out, repo)] == ["stale"]

    order = []
    stories.clear()
    stories["T-001"] = evidence.Story("T-001", "a", "synthetic", lambda ctx: order.append("T-001") or ctx.check("x", True),
                                      False)
    stories["T-002"] = evidence.Story("T-002", "b", "synthetic", lambda ctx: order.append("T-002") or ctx.check("x", True),
                                      False, all_prep=lambda: order.append("prep") or "prepared")
    assert [ok for _, ok, _ in evidence.run_all(tmp_path / "ev")] == [True, True]
    assert order == ["T-001", "prep", "T-002"]

    def broken_prep():
        raise OSError("disk full")
    stories["T-002"] = evidence.Story("T-002", "b", "synthetic", lambda ctx: order.append("T-002") or ctx.check("x", True),
                                      False, all_prep=broken_prep)
    order.clear()                                                          # a failed prep does not stop --all
    assert [ok for _, ok, _ in evidence.run_all(tmp_path / "ev")] == [True, True] and order == ["T-001", "T-002"]
    order.clear()
    evidence.run_story("T-002", tmp_path / "ev")                           # a named run checks as committed
    assert order == ["T-002"]


def test_all_lets_the_host_settle_before_a_timing_story_and_every_run_states_its_load(stories, tmp_path, monkeypatch):
    loads = iter([2.0, 1.2, 0.4] + [0.3] * 50)
    monkeypatch.setattr(evidence.os, "getloadavg", lambda: (next(loads), 0.9, 0.8))
    slept = []
    monkeypatch.setattr(evidence.time, "sleep", slept.append)
    assert evidence.settle(limit_s=60)[0] == 0.4 and len(slept) == 2          # waits until quiet
    monkeypatch.setattr(evidence.os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    load, _ = evidence.settle(limit_s=0.05, poll_s=0.01)                       # bounded: gives up, says the load
    assert load == 3.0

    settled = []
    monkeypatch.setattr(evidence, "settle", lambda: settled.append(1) or (0.3, 12.0))
    stories.clear()
    stories["T-001"] = evidence.Story("T-001", "a", "synthetic", lambda ctx: ctx.check("x", True), False)
    stories["T-002"] = evidence.Story("T-002", "b", "synthetic", lambda ctx: ctx.check("x", True), False, measures=True)
    evidence.run_all(tmp_path)
    assert settled == [1]                                                      # only before the timing story
    env = json.loads((tmp_path / "T-001" / "environment.json").read_text())
    assert env["load_average_at_start"] == [3.0, 3.0, 3.0]
    assert "load average at start 3.00/3.00/3.00" in (tmp_path / "T-001" / "README.md").read_text()


def test_the_derived_path_is_written_once_and_the_release_lane_agrees():
    """The render's default folder is the one derived path; quickstart.sh's clean-tree check (a
    shell copy, it runs before any venv exists) excludes exactly that path and the evidence."""
    import re

    from dgr import paths
    from dgr.upstream import outreach

    root = paths.repo_root()
    assert evidence.DERIVED_PATHS == (outreach.default_out_dir().relative_to(root).as_posix(),)
    script = (root / "quickstart.sh").read_text()
    line = next(x for x in script.splitlines() if x.strip().startswith("dirty=$(git status"))
    assert sorted(re.findall(r":\(exclude\)([^'\"]+)", line)) == sorted(["evidence", *evidence.DERIVED_PATHS])


def test_story_counts_from_the_environment_are_checked(monkeypatch):
    """DGR_GATE_REPEATS and DGR_BENCH_THREADS: unset means the default; anything but a whole number
    in range is refused by name, never read as the default."""
    from dgr.accept.stories._common import env_count
    from dgr.errors import DgrError

    monkeypatch.delenv("DGR_GATE_REPEATS", raising=False)
    assert env_count("DGR_GATE_REPEATS", 1, 9) is None
    monkeypatch.setenv("DGR_GATE_REPEATS", " 3 ")
    assert env_count("DGR_GATE_REPEATS", 1, 9) == 3
    for bad in ("three", "2.5", "0", "10", "-1"):
        monkeypatch.setenv("DGR_GATE_REPEATS", bad)
        with pytest.raises(DgrError, match="DGR_GATE_REPEATS"):
            env_count("DGR_GATE_REPEATS", 1, 9)
