"""Patch-stack manager on small throwaway repositories (no llama.cpp needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gitfixtures import LINES, PATCH_BODY, commit_file, fake_checkout, git, make_upstream  # noqa: E402

from dgr.upstream import patchstack  # noqa: E402
from dgr.errors import DgrError  # noqa: E402


@pytest.fixture()
def upstream(tmp_path: Path):
    up = tmp_path / "upstream"
    base = make_upstream(up, {"src/a.c": LINES, "src/b.c": "int b;\n", "LICENSE": "MIT\n"})
    return up, base


def _make_series(tmp_path: Path, up: Path, base: str, *, forwarded: bool = True) -> patchstack.Stack:
    """Create two patch commits in a dev tree and export them."""
    stack = patchstack.Stack(tmp_path / "patches", base, tmp_path / "assumptions.toml")
    stack.patches_dir.mkdir()
    stack.series_file.write_text("")
    dev = tmp_path / "dev"
    patchstack.apply(stack, up, dev)
    body = PATCH_BODY if forwarded else "Why: tests.\n"
    commit_file(dev, "src/a.c", LINES.replace("line 20\n", "line 20 patched\n"), f"a : patch line 20\n\n{body}")
    commit_file(dev, "src/b.c", "int b = 1;\n", f"b : initialise b\n\n{body}")
    return stack, dev


def test_export_apply_verify_roundtrip(tmp_path, upstream):
    up, base = upstream
    stack, dev = _make_series(tmp_path, up, base)
    names = patchstack.export(stack, dev)
    assert names == ["0001-a-patch-line-20.patch", "0002-b-initialise-b.patch"]
    assert stack.series() == names
    first = {n: (stack.patches_dir / n).read_bytes() for n in names}
    assert b"Forwarded: no" in first[names[0]]
    assert b"From 0000000000000000000000000000000000000000" in first[names[0]]
    # Re-export is byte-identical (stable options).
    patchstack.export(stack, dev)
    assert {n: (stack.patches_dir / n).read_bytes() for n in names} == first
    # Fresh apply: one commit per patch on top of the recorded base.
    tree = tmp_path / "tree"
    st = patchstack.apply(stack, up, tree)
    assert st.base == base
    assert st.applied == ["a : patch line 20", "b : initialise b"]
    assert (tree / "src/a.c").read_text().count("line 20 patched") == 1
    assert git(tree, "rev-parse", patchstack.BASE_REF) == base
    patchstack.refresh_assumption_blobs(stack, tree)
    report = patchstack.verify(stack, up)
    assert report.ok, report.problems
    assert report.digest.startswith("sha256:")


def test_apply_is_idempotent_and_refuses_local_edits(tmp_path, upstream):
    up, base = upstream
    stack, dev = _make_series(tmp_path, up, base)
    patchstack.export(stack, dev)
    tree = tmp_path / "tree"
    patchstack.apply(stack, up, tree)
    marker = (tree / "src/a.c").stat().st_mtime_ns
    patchstack.apply(stack, up, tree)  # nothing to do: timestamps kept
    assert (tree / "src/a.c").stat().st_mtime_ns == marker
    (tree / "src/b.c").write_text("edited\n")
    st = patchstack.state(stack, tree)
    assert st.dirty and "src/b.c" in st.dirty[0]
    with pytest.raises(DgrError, match="local edits"):
        patchstack.apply(stack, up, tree)
    patchstack.apply(stack, up, tree, force=True)
    assert (tree / "src/b.c").read_text() == "int b = 1;\n"


def test_status_reports_unexported_commit(tmp_path, upstream):
    up, base = upstream
    stack, dev = _make_series(tmp_path, up, base)
    patchstack.export(stack, dev)
    commit_file(dev, "src/b.c", "int b = 2;\n", f"b : second value\n\n{PATCH_BODY}")
    st = patchstack.state(stack, dev)
    assert st.unexported == ["0003-b-second-value.patch"]


def test_export_requires_forwarded_line(tmp_path, upstream):
    up, base = upstream
    stack, dev = _make_series(tmp_path, up, base, forwarded=False)
    with pytest.raises(DgrError, match="Forwarded:"):
        patchstack.export(stack, dev)


def test_patch_that_no_longer_applies_is_named(tmp_path, upstream):
    up, base = upstream
    stack, dev = _make_series(tmp_path, up, base)
    patchstack.export(stack, dev)
    # Upstream moves: line 20 changes, so the first patch's context no longer matches.
    new_base = commit_file(up, "src/a.c", LINES.replace("line 20\n", "line twenty\n"), "upstream edit")
    moved = patchstack.Stack(stack.patches_dir, new_base, stack.assumptions_file)
    with pytest.raises(DgrError, match="0001-a-patch-line-20.patch does not apply"):
        patchstack.apply(moved, up, tmp_path / "tree2")
    report = patchstack.verify(moved, up)
    assert not report.ok
    assert "0001-a-patch-line-20.patch does not apply" in report.problems[0]


def test_stale_patch_detected(tmp_path, upstream):
    up, base = upstream
    stack, dev = _make_series(tmp_path, up, base)
    patchstack.export(stack, dev)
    tree = tmp_path / "tree"
    patchstack.apply(stack, up, tree)
    patchstack.refresh_assumption_blobs(stack, tree)
    # Upstream adds lines at the top: the patch still applies (with an offset), but its
    # re-export differs from the committed file -> stale.
    new_base = commit_file(up, "src/a.c", "new 1\nnew 2\n" + LINES, "upstream insert")
    moved = patchstack.Stack(stack.patches_dir, new_base, None)
    report = patchstack.verify(moved, up)
    assert not report.ok
    assert any("0001-a-patch-line-20.patch: stale" in p for p in report.problems), report.problems


def test_changed_upstream_assumption(tmp_path, upstream):
    up, base = upstream
    stack, dev = _make_series(tmp_path, up, base)
    patchstack.export(stack, dev)
    tree = tmp_path / "tree"
    patchstack.apply(stack, up, tree)
    stack.assumptions_file.write_text(
        '[[symbol]]\nname = "b"\nfile = "src/b.c"\npattern = \'\'\'int b\'\'\'\n')
    patchstack.refresh_assumption_blobs(stack, tree)
    assert patchstack.verify(stack, up).ok
    # A listed file's blob at the base no longer matches (the pin moved / upstream changed it).
    new_base = commit_file(up, "src/b.c", "int b;\nint c;\n", "upstream touches b.c")
    moved = patchstack.Stack(stack.patches_dir, new_base, stack.assumptions_file)
    report = patchstack.verify(moved, up)
    assert any("assumption changed: upstream file src/b.c" in p for p in report.problems), report.problems
    # A symbol the worker relies on disappears.
    stack.assumptions_file.write_text(stack.assumptions_file.read_text().replace("int b", "int gone"))
    report = patchstack.verify(stack, up)
    assert any("symbol b not found in src/b.c" in p for p in report.problems), report.problems


def test_unlisted_touched_file_is_a_problem(tmp_path, upstream):
    up, base = upstream
    stack, dev = _make_series(tmp_path, up, base)
    patchstack.export(stack, dev)
    stack.assumptions_file.write_text("")
    report = patchstack.verify(stack, up)
    assert any("assumption missing: patches touch src/a.c" in p for p in report.problems)


def _dgr(env, *args):
    return subprocess.run([sys.executable, "-m", "dgr.main", *args], env=env, capture_output=True, text=True)


def test_cli_verify_exit_codes_and_one_line_reasons(tmp_path, upstream):
    up, base = upstream
    env = fake_checkout(tmp_path / "checkout", up, base)
    root = tmp_path / "checkout"
    stack = patchstack.Stack(root / "upstream/patches", base, root / "upstream/assumptions.toml")
    dev = tmp_path / "dev"
    patchstack.apply(stack, up, dev)
    commit_file(dev, "src/a.c", LINES.replace("line 20\n", "line 20 patched\n"), f"a : patch\n\n{PATCH_BODY}")
    patchstack.export(stack, dev)
    patchstack.refresh_assumption_blobs(stack, dev)
    ok = _dgr(env, "patches", "verify")
    assert ok.returncode == 0, ok.stderr
    assert "patches ok: 1 patch(es)" in ok.stdout
    # Changed assumption -> non-zero, one line naming it.
    text = (root / "upstream/assumptions.toml").read_text()
    blob = git(up, "rev-parse", f"{base}:src/a.c")
    (root / "upstream/assumptions.toml").write_text(text.replace(blob, "0" * 40))
    bad = _dgr(env, "patches", "verify")
    assert bad.returncode == 1
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("dgr: error: patch stack does not verify: assumption changed: upstream file src/a.c")
    (root / "upstream/assumptions.toml").write_text(text)
    # Patch that no longer applies -> non-zero, names it.
    patch = root / "upstream/patches" / stack.series()[0]
    patch.write_text(patch.read_text().replace("-line 20\n", "-line 2O\n"))
    bad = _dgr(env, "patches", "verify")
    assert bad.returncode == 1
    assert "0001-a-patch.patch does not apply" in bad.stderr.strip().splitlines()[-1]
    # `dgr patches apply` on the real flow creates build/llama.cpp under DGR_BUILD_DIR.
    patch.write_text(patch.read_text().replace("-line 2O\n", "-line 20\n"))
    applied = _dgr(env, "patches", "apply")
    assert applied.returncode == 0, applied.stderr
    status = _dgr(env, "patches", "status")
    assert "clean: tree matches the committed series" in status.stdout
