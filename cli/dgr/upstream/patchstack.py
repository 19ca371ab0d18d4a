"""The llama.cpp patch stack (Electron ``patches/`` / ``gbp pq`` style).

``upstream/patches/series`` lists the patch files in order; each is a ``git format-patch``
file exported with stable options so re-exporting does not churn it. ``apply`` makes a git
working tree of the pinned source, records the base as ``refs/dgr/base`` and applies the
series with ``git am`` (one commit per patch, no fuzz). ``export`` regenerates the numbered
files from those commits. ``verify`` applies at the exact base in a scratch tree, re-exports and
byte-compares, and checks the upstream assumptions file.

Everything here takes explicit paths so the tests can drive it on throwaway repositories.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import git

from .. import paths
from ..errors import DgrError

BASE_REF = "refs/dgr/base"
BRANCH = "dgr-patched"
FORMAT_PATCH_OPTS = (
    "--keep-subject", "--no-stat", "--no-signature", "--zero-commit", "--full-index",
    "--no-numbered", "--no-renames", "--encoding=UTF-8",
)
GIT_IDENTITY = ("-c", "user.name=dgr patch stack", "-c", "user.email=dgr@localhost",
                "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false")
REQUIRED_FIELDS = ("Forwarded:",)


class PatchError(DgrError):
    pass


@dataclass(frozen=True)
class Stack:
    """A patch series against one base commit of an upstream repository."""

    patches_dir: Path
    base_commit: str
    assumptions_file: Path | None = None

    @property
    def series_file(self) -> Path:
        return self.patches_dir / "series"

    def series(self) -> list[str]:
        if not self.series_file.is_file():
            raise PatchError(f"series file missing: {self.series_file}")
        names = []
        for line in self.series_file.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                names.append(line)
        for n in names:
            if not (self.patches_dir / n).is_file():
                raise PatchError(f"series names {n}, but {self.patches_dir / n} does not exist")
        return names

    def series_digest(self) -> str:
        """sha256 over the series order and every patch's bytes; identifies the stack."""
        h = hashlib.sha256()
        for name in self.series():
            data = (self.patches_dir / name).read_bytes()
            h.update(f"{name}\0{len(data)}\0".encode())
            h.update(data)
        return "sha256:" + h.hexdigest()


def default_stack() -> Stack:
    from .pin import load_pin

    return Stack(
        patches_dir=paths.patches_dir(),
        base_commit=load_pin().commit,
        assumptions_file=paths.repo_root() / "upstream" / "assumptions.toml",
    )


def _git(repo: Path, *args: str) -> str:
    try:
        return git.Git(str(repo)).execute(["git", *GIT_IDENTITY, *args], strip_newline_in_stdout=True)
    except git.GitCommandError as exc:
        msg = (exc.stderr or exc.stdout or str(exc)).strip().replace("\n", " | ")
        raise PatchError(f"git {' '.join(args[:2])} failed in {repo}: {msg}") from None


# ---------------------------------------------------------------------------- apply


@dataclass
class TreeState:
    base: str | None
    applied: list[str] = field(default_factory=list)  # subjects, base..HEAD, oldest first
    dirty: list[str] = field(default_factory=list)    # porcelain lines
    unexported: list[str] = field(default_factory=list)  # series names whose export differs / new


def _subject_of(patch: Path) -> str:
    text = patch.read_text(errors="replace")
    m = re.search(r"^Subject: (.*(?:\n .*)*)", text, re.M)
    return re.sub(r"\s*\n\s+", " ", m.group(1)).strip() if m else patch.name


def _clone(source: Path, dest: Path, base: str) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # --no-local copies objects through the pack protocol, which works from shallow sources too.
    _git(dest.parent, "clone", "--quiet", "--no-checkout", "--no-local", str(source), str(dest))
    _git(dest, "update-ref", BASE_REF, base)
    _git(dest, "checkout", "--quiet", "-B", BRANCH, base)


def apply(stack: Stack, source: Path, dest: Path, *, force: bool = False) -> TreeState:
    """Make ``dest`` = ``source`` at the base with the series applied (one commit per patch).

    Idempotent: when ``dest`` already has exactly this base and these patches applied and no
    local edits, nothing is touched (so build trees keep their timestamps). ``force`` recreates.
    """
    names = stack.series()
    if dest.exists() and not force:
        try:
            st = state(stack, dest)
        except PatchError:
            st = None
        if st and st.base == stack.base_commit and not st.dirty and not st.unexported \
                and len(st.applied) == len(names):
            return st
        if st and st.dirty:
            raise PatchError(
                f"{dest} has local edits not committed: {st.dirty[0]}",
                hint="commit them and run `dgr patches export`, or re-run with --force to discard",
            )
        if st and st.base == stack.base_commit and len(st.applied) > len(names):
            raise PatchError(
                f"{dest} has {len(st.applied) - len(names)} commit(s) not in the series",
                hint="run `dgr patches export` to keep them, or --force to discard",
            )
    _clone(source, dest, stack.base_commit)
    for name in names:
        try:
            _git(dest, "am", "--quiet", "--keep", "--no-3way", "--whitespace=nowarn",
                 "--committer-date-is-author-date", str(stack.patches_dir / name))
        except PatchError as exc:
            try:
                _git(dest, "am", "--abort")
            except PatchError:
                pass
            raise PatchError(f"patch {name} does not apply at {stack.base_commit[:12]}: {exc}") from None
    return state(stack, dest)


def state(stack: Stack, tree: Path) -> TreeState:
    if not (tree / ".git").exists():
        raise PatchError(f"{tree} is not a patched tree", hint="run `dgr patches apply`")
    try:
        base = _git(tree, "rev-parse", "--verify", "--quiet", BASE_REF)
    except PatchError:
        base = None
    st = TreeState(base=base)
    if base:
        log = _git(tree, "log", "--reverse", "--format=%s", f"{base}..HEAD")
        st.applied = [s for s in log.splitlines() if s]
    porcelain = _git(tree, "status", "--porcelain", "--untracked-files=normal")
    st.dirty = [ln for ln in porcelain.splitlines() if ln.strip()]
    if base:
        st.unexported = _unexported(stack, tree, base)
    return st


def _format_patches(tree: Path, base: str, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    listing = _git(tree, "format-patch", *FORMAT_PATCH_OPTS, "-o", str(out), f"{base}..HEAD")
    return [Path(p) for p in listing.splitlines() if p.strip()]


def _unexported(stack: Stack, tree: Path, base: str) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="dgr-export-") as tmp:
        produced = _format_patches(tree, base, Path(tmp))
        committed = stack.series() if stack.series_file.is_file() else []
        diffs = []
        for i, p in enumerate(produced):
            if i >= len(committed) or committed[i] != p.name \
                    or (stack.patches_dir / committed[i]).read_bytes() != p.read_bytes():
                diffs.append(p.name)
        diffs.extend(f"(removed) {n}" for n in committed[len(produced):])
        return diffs


# ---------------------------------------------------------------------------- export


def export(stack: Stack, tree: Path) -> list[str]:
    """Regenerate the numbered patch files and ``series`` from ``base..HEAD`` of ``tree``."""
    st = state(stack, tree)
    if st.base is None:
        raise PatchError(f"{tree} has no recorded base ({BASE_REF})", hint="run `dgr patches apply`")
    if st.base != stack.base_commit:
        raise PatchError(f"{tree} is based on {st.base[:12]}, the pin says {stack.base_commit[:12]}")
    if st.dirty:
        raise PatchError(f"{tree} has uncommitted edits ({st.dirty[0]})", hint="commit them first")
    old = stack.series() if stack.series_file.is_file() else []
    with tempfile.TemporaryDirectory(prefix="dgr-export-") as tmp:
        produced = _format_patches(tree, st.base, Path(tmp))
        for p in produced:
            _check_description(p)
        stack.patches_dir.mkdir(parents=True, exist_ok=True)
        for name in old:
            (stack.patches_dir / name).unlink(missing_ok=True)
        names = []
        for p in produced:
            shutil.copyfile(p, stack.patches_dir / p.name)
            names.append(p.name)
    header = "# Patch order for the pinned llama.cpp. Written by `dgr patches export`.\n"
    stack.series_file.write_text(header + "".join(n + "\n" for n in names))
    return names


def _check_description(patch: Path) -> None:
    text = patch.read_text(errors="replace")
    head = text.split("\n---\n", 1)[0] if "\n---\n" in text else text.split("\ndiff --git", 1)[0]
    missing = [f for f in REQUIRED_FIELDS if f not in head]
    if missing:
        raise PatchError(
            f"patch '{_subject_of(patch)}' lacks {', '.join(missing)} in its description",
            hint="say why it exists, whether it is upstreamable, and add a Forwarded: line",
        )


# ---------------------------------------------------------------------------- verify


@dataclass
class VerifyReport:
    ok: bool
    problems: list[str]
    patches: list[str]
    digest: str


def verify(stack: Stack, source: Path, scratch: Path | None = None) -> VerifyReport:
    """Apply the series at the exact base in a scratch tree, re-export and byte-compare,
    and check the upstream assumptions. Never raises for a finding: returns every problem."""
    problems: list[str] = []
    names = stack.series()
    for n in names:
        try:
            _check_description(stack.patches_dir / n)
        except PatchError as exc:
            problems.append(f"{n}: {exc}")
    tmpdir = None
    if scratch is None:
        tmpdir = tempfile.TemporaryDirectory(prefix="dgr-verify-")
        scratch = Path(tmpdir.name) / "tree"
    try:
        if stack.assumptions_file is not None:
            try:
                problems.extend(check_file_assumptions(stack, source))
            except PatchError as exc:
                problems.append(str(exc))
        try:
            apply(stack, source, scratch, force=True)
        except PatchError as exc:
            problems.insert(0, str(exc))
            return VerifyReport(False, problems, names, stack.series_digest())
        with tempfile.TemporaryDirectory(prefix="dgr-reexport-") as tmp:
            produced = _format_patches(scratch, stack.base_commit, Path(tmp))
            for i, n in enumerate(names):
                if i >= len(produced):
                    problems.append(f"{n}: produced no commit when applied (empty patch?)")
                    continue
                if produced[i].name != n:
                    problems.append(f"{n}: re-export names it {produced[i].name} (renamed by hand?)")
                elif produced[i].read_bytes() != (stack.patches_dir / n).read_bytes():
                    problems.append(f"{n}: stale: re-export differs from the committed file "
                                    "(run `dgr patches apply && dgr patches export`)")
        if stack.assumptions_file is not None and stack.assumptions_file.is_file():
            problems.extend(check_tree_assumptions(stack, scratch))
    finally:
        if tmpdir is not None:
            tmpdir.cleanup()
    return VerifyReport(not problems, problems, names, stack.series_digest())


# ---------------------------------------------------------------------------- assumptions


def load_assumptions(path: Path) -> dict:
    if not path.is_file():
        raise PatchError(f"upstream assumptions file missing: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PatchError(f"{path} is not valid TOML: {exc}") from None


def touched_files(tree: Path, base: str) -> list[str]:
    out = _git(tree, "diff", "--name-only", "--no-renames", f"{base}..HEAD")
    return sorted({ln for ln in out.splitlines() if ln})


def check_file_assumptions(stack: Stack, repo: Path) -> list[str]:
    """Each listed upstream file must still be the listed blob at the base (checked in any
    repository holding the base commit, so it also works when the patches no longer apply)."""
    data = load_assumptions(stack.assumptions_file)  # type: ignore[arg-type]
    problems = []
    base = stack.base_commit
    for f in data.get("file", []):
        path, blob = f["path"], f["blob"]
        try:
            actual = _git(repo, "rev-parse", "--verify", "--quiet", f"{base}:{path}")
        except PatchError:
            actual = None
        if not actual:
            if blob != "new":
                problems.append(f"assumption changed: upstream file {path} does not exist at {base[:12]}")
        elif blob != actual:
            problems.append(f"assumption changed: upstream file {path} is blob {actual[:12]} at "
                            f"{base[:12]}, the assumptions file says {blob[:12]}")
    return problems


def check_tree_assumptions(stack: Stack, patched: Path) -> list[str]:
    """Every file the series touches must be listed, and every listed symbol must be found
    in the patched tree."""
    data = load_assumptions(stack.assumptions_file)  # type: ignore[arg-type]
    problems = []
    listed = {f["path"] for f in data.get("file", [])}
    for path in touched_files(patched, stack.base_commit):
        if path not in listed:
            problems.append(f"assumption missing: patches touch {path}, which the assumptions file does not list")
    for sym in data.get("symbol", []):
        f = patched / sym["file"]
        text = f.read_text(errors="replace") if f.is_file() else ""
        pattern = sym.get("pattern") or re.escape(sym["name"])
        if not re.search(pattern, text, re.M):
            problems.append(f"assumption changed: symbol {sym['name']} not found in {sym['file']}")
    return problems


def check_assumptions(stack: Stack, patched: Path) -> list[str]:
    return check_file_assumptions(stack, patched) + check_tree_assumptions(stack, patched)


def refresh_assumption_blobs(stack: Stack, patched: Path) -> list[str]:
    """Rewrite the file list of the assumptions file from what the series touches (blob hashes
    at the base), keeping the symbol list. For use when adding a patch or moving the pin."""
    data = load_assumptions(stack.assumptions_file) if stack.assumptions_file.is_file() else {}  # type: ignore[union-attr]
    base = stack.base_commit
    files = []
    for path in touched_files(patched, base):
        try:
            blob = _git(patched, "rev-parse", f"{base}:{path}")
        except PatchError:
            blob = "new"
        files.append((path, blob))
    lines = [
        "# Upstream assumptions of the patch stack and the worker, checked by `dgr patches verify`.",
        "# [[file]]: every upstream file the patches touch, with its git blob at the pinned base",
        "#           (refresh with `dgr patches assumptions --refresh`).",
        "# [[symbol]]: public llama.cpp symbols / struct fields the worker relies on; `pattern` is a",
        "#             regular expression that must match in `file` of the patched tree.",
        f"base = \"{base}\"",
        "",
    ]
    for path, blob in files:
        lines += ["[[file]]", f"path = \"{path}\"", f"blob = \"{blob}\"", ""]
    for sym in data.get("symbol", []):
        lines += ["[[symbol]]", f"name = \"{sym['name']}\"", f"file = \"{sym['file']}\""]
        if "pattern" in sym:
            lines.append("pattern = '''" + sym["pattern"] + "'''")
        lines.append("")
    stack.assumptions_file.write_text("\n".join(lines))  # type: ignore[union-attr]
    return [p for p, _ in files]
