"""DGR-004: the exact pin, a clean patch stack, a clean rebuild, upstream assumptions."""

from __future__ import annotations

import compileall
import re
import sys

from ... import paths
from ...upstream import patchstack
from ...upstream import pin as pin_mod
from ..evidence import StoryContext, story
from ._common import tests_criterion


def _dgr(ctx: StoryContext, *args: str, env: dict | None = None):
    return ctx.command([sys.executable, "-m", "dgr.main", *args], env=env)


@story("DGR-004", "Pinned llama.cpp, clean patch stack, reproducible worker build", lane="synthetic")
def run(ctx: StoryContext) -> None:
    pin = pin_mod.load_pin()
    ctx.results["pin_commit"] = pin.commit
    ctx.results["sdist_sha256"] = pin.sdist.sha256

    proc = _dgr(ctx, "pin", "fetch")
    ctx.check("`dgr pin fetch` obtains the hash-pinned source", proc.returncode == 0,
              (proc.stdout or proc.stderr).strip().splitlines()[-1] if (proc.stdout or proc.stderr) else "")
    proc = _dgr(ctx, "pin", "verify")
    ctx.check("`dgr pin verify`: archive sha256, exact commit, clean worktree", proc.returncode == 0,
              proc.stdout.strip() or proc.stderr.strip()[-300:])

    proc = _dgr(ctx, "patches", "verify")
    ctx.check("`dgr patches verify`: series applies at the exact pin without fuzz and re-exports byte-identically",
              proc.returncode == 0, proc.stdout.strip() or proc.stderr.strip()[-300:])
    stack = patchstack.default_stack()
    ctx.results["patch_series"] = names = stack.series()
    ctx.results["patch_series_digest"] = stack.series_digest()
    root = paths.repo_root()
    in_order = [n for i, n in enumerate(names, 1) if re.fullmatch(rf"{i:04d}-[^/]+\.patch", n)]
    ctx.check("numbered patch series (0001-… in series order) stored in upstream/patches, apart from the worker "
              "and Meshnet adapter code",
              bool(names) and len(in_order) == len(names)
              and stack.patches_dir.resolve() == (root / "upstream" / "patches").resolve(),
              f"{len(names)} patch(es) in {stack.patches_dir}; out of order or unnumbered: "
              + (", ".join(sorted(set(names) - set(in_order))) or "none"))

    proc = _dgr(ctx, "patches", "apply")
    tree = paths.patched_source_dir()
    problems = patchstack.check_assumptions(stack, tree) if proc.returncode == 0 else ["apply failed"]
    listed = patchstack.load_assumptions(stack.assumptions_file)
    if not listed.get("file") or not listed.get("symbol"):   # an empty list holds vacuously
        problems.append("the assumptions file lists no upstream files or no symbols")
    ctx.record_command(f"patchstack.check_assumptions(default_stack(), {tree})")
    ctx.check("upstream assumptions hold (touched files' blobs at the pin, worker symbols present)",
              not problems, "; ".join(problems) or f"{len(patchstack.load_assumptions(stack.assumptions_file).get('symbol', []))} symbol(s), "
              f"{len(patchstack.touched_files(tree, stack.base_commit))} touched file(s)")
    tests_criterion(ctx, "a changed pin or upstream assumption fails with a one-line reason (wrong commit, dirty tree, "
                         "tampered archive, changed file blob, unlisted touched file, patch that no longer applies)",
                    ["tests/test_pin.py::test_verify_tree_wrong_commit_and_dirty",
                     "tests/test_pin.py::test_tampered_archive_is_rejected",
                     "tests/test_patchstack.py::test_changed_upstream_assumption",
                     "tests/test_patchstack.py::test_unlisted_touched_file_is_a_problem",
                     "tests/test_patchstack.py::test_patch_that_no_longer_applies_is_named",
                     "tests/test_patchstack.py::test_stale_patch_detected",
                     "tests/test_patchstack.py::test_cli_verify_exit_codes_and_one_line_reasons"])

    # A clean rebuild from scratch in a scratch build directory (pin cache shared, nothing else).
    scratch = ctx.tmp / "build"
    env = {"DGR_BUILD_DIR": str(scratch), "DGR_PIN_CACHE": str(paths.pin_cache_dir())}
    proc = _dgr(ctx, "build", "--backend", "cpu", "--clean", env=env)
    worker = scratch / "cpu" / "bin" / "dgr-worker"
    ctx.check("clean rebuild from scratch: `dgr build --backend cpu --clean`", proc.returncode == 0 and worker.is_file(),
              proc.stdout.strip() or proc.stderr.strip()[-300:])
    if worker.is_file():
        ver = ctx.command([str(worker), "--version"])
        ctx.results["worker_version"] = ver.stdout.strip().splitlines()
        ctx.check("`dgr-worker --version` prints the pinned commit, patch digest and backend",
                  ver.returncode == 0 and pin.commit in ver.stdout and stack.series_digest() in ver.stdout
                  and "backend cpu" in ver.stdout, ver.stdout.strip().replace("\n", "; "))
        smoke = ctx.command([str(worker), "--smoke"])
        ctx.check("`dgr-worker --smoke` initialises the llama.cpp backends", smoke.returncode == 0 and "smoke: ok" in smoke.stdout,
                  (smoke.stdout.strip().splitlines() or [""])[-1])
        notices = [n for n in pin.notices if (worker.parent / f"llama.cpp-{n}").is_file()]
        ctx.check("upstream LICENSE and AUTHORS notices are next to the binary",
                  "LICENSE" in pin.notices and len(notices) == len(pin.notices),
                  ", ".join(f"llama.cpp-{n}" for n in notices))

    ok = all(compileall.compile_dir(str(root / d), quiet=1, force=True) for d in ("cli", "meshnet_adapter"))
    ctx.record_command("python -m compileall cli meshnet_adapter")
    ctx.check("`python -m compileall` is clean", ok)
    diff = ctx.command(["git", "-C", str(root), "diff", "--check", "HEAD"])
    ctx.check("`git diff --check` is clean", diff.returncode == 0, diff.stdout.strip()[:300])
    ctx.limitation("The clean rebuild needs no model file, but this story does not isolate the network: it does not "
                   "prove that nothing but the hash-pinned source archive is downloaded.")
    ctx.limitation("Backends other than cpu are checked for their toolchain only; this machine has no GPU.")
