"""DGR-016: the upstream llama.cpp collaboration package, at the pin.

- the patch series (``upstream/patches/``): every patch applies at the exact pin and re-exports
  byte-identically (`dgr patches verify`); one commit per patch file, a subject of its own and a
  pull-request text of its own;
- generic hooks apart from our protocol/control plane: the patches touch only llama.cpp's
  ``include/`` and ``src/`` and add no line naming the protocol, the Tracker or Meshnet; the
  worker and the examples reach llama.cpp through its public headers only;
- the examples and tests (``upstream/outreach/examples/``) as `dgr upstream check` builds them
  (``build/outreach-<backend>/``, checked to be built from this pin and series, not rebuilt here),
  run on the two synthetic models and on the story's model (SmolLM2-135M by default);
- the outreach document (`dgr upstream render`): rendered into a scratch folder, the committed
  render up to date, the proposal naming the pin, every patch's text, its comparisons and why
  the API is generally useful. Nothing is sent: proposing upstream stays a human action.
"""

from __future__ import annotations

import re
from pathlib import Path

from ... import paths
from ..evidence import DERIVED_PATHS, StoryContext, story
from ._common import command_criterion, dgr, tests_criterion

T = "tests/"
# names of this project's protocol and control plane, never in a line the patches add
OURS = re.compile(r"meshnet|grpc|protobuf|\bproto\b|tracker|\bdgr\b|dgr[_-]|shard[_ ]runtime|relay|route session",
                  re.I)
# what each program of the examples shows (upstream/outreach/examples/tests, split-simple)
CONCERNS = (
    ("range-aware loading: a range loads only its layers, and keeps only its weights of a mapped file "
     "resident", ("test-layer-range", "test-range-mmap")),
    ("boundary input and output: a model without token embedding takes residual rows, the head hands on the "
     "whole model's residual stream bit for bit", ("test-boundary-input", "test-boundary-output")),
    ("layer-filtered KV: a range caches only its own layers", ("test-layer-kv",)),
    ("the minimal reproducible example: a model run as two layer ranges equals the whole model",
     ("llama-split-simple",)),
)
COMPARED = (("Nakshatra", "https://github.com/fthrvi/nakshatra"), ("prima.cpp", "https://github.com/Lizonghang/prima.cpp"))


def _scoped_patches(ctx: StoryContext) -> list:
    """One commit per patch file, distinct subjects, the Upstreamable/Forwarded lines (read_series)."""
    from ...upstream import outreach, patchstack

    stack = patchstack.default_stack()
    ctx.record_command("dgr.upstream.outreach.read_series() over upstream/patches/series")
    patches = outreach.read_series(stack)
    problems = []
    for p in patches:
        text = (stack.patches_dir / p.file).read_text(encoding="utf-8")
        commits = len(re.findall(r"^From [0-9a-f]{40} ", text, re.M))
        if commits != 1:
            problems.append(f"{p.file} holds {commits} commits")
    subjects = [p.subject for p in patches]
    dupes = sorted({s for s in subjects if subjects.count(s) > 1})
    problems += [f"subject used twice: {s}" for s in dupes]
    ctx.results["patches"] = [{"file": p.file, "subject": p.subject, "files": [f.path for f in p.files],
                               "added": p.added, "removed": p.removed, "upstreamable": p.upstreamable,
                               "forwarded": p.forwarded} for p in patches]
    ctx.check("one scoped commit per concern: each patch file is one commit with a subject of its own",
              bool(patches) and not problems,
              "; ".join(problems) or f"{len(patches)} patch file(s), one commit each, {len(set(subjects))} distinct "
              f"subjects: " + "; ".join(f"{p.number} {p.subject} ({len(p.files)} file(s), +{p.added}/-{p.removed})"
                                         for p in patches))
    return patches


def _separation(ctx: StoryContext, patches: list) -> None:
    from ...upstream import patchstack

    stack = patchstack.default_stack()
    outside, named = [], []
    for p in patches:
        outside += [f"{p.number}:{f.path}" for f in p.files if not f.path.startswith(("include/", "src/"))]
        text = (stack.patches_dir / p.file).read_text(encoding="utf-8")
        added = [ln[1:] for ln in text.split("\ndiff --git ", 1)[-1].splitlines()
                 if ln.startswith("+") and not ln.startswith("+++")]
        named += [f"{p.number}: {ln.strip()[:80]}" for ln in added if OURS.search(ln)]
    files = sorted({f.path for p in patches for f in p.files})
    ctx.record_command("scan of the lines upstream/patches/*.patch add, for this project's protocol/control-plane names")
    ctx.check("generic hooks apart from Meshnet protocol/control-plane code: the patches touch only llama.cpp's "
              "include/ and src/ and add no line naming the protocol, relay, Tracker or Meshnet",
              bool(files) and not outside and not named,
              "; ".join(outside + named)[:400] or f"{len(files)} upstream file(s) touched, all under include/ or src/: "
              + ", ".join(files))
    # the other side: our code (worker) and the examples reach llama.cpp through its public headers only
    tree = paths.patched_source_dir()
    private = {h.name for h in (tree / "src").rglob("*.h")} if (tree / "src").is_dir() else set()
    public = {h.name for d in ("include", "ggml/include", "common") if (tree / d).is_dir() for h in (tree / d).rglob("*.h")}
    root = paths.repo_root()
    used: dict[str, set[str]] = {}
    for base in (root / "worker" / "src", root / "worker" / "tools", root / "upstream" / "outreach" / "examples"):
        for f in base.rglob("*"):
            if f.suffix in (".cpp", ".h", ".cc", ".hpp"):
                for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read_text(errors="replace"), re.M):
                    if (f.parent / inc).is_file() or (root / "worker" / "src" / inc).is_file():
                        continue   # our own header
                    used.setdefault(Path(inc).name, set()).add(f.relative_to(root).as_posix())
    upstream_used = sorted(h for h in used if h in public | private)
    bad = sorted(f"{h} (in {sorted(used[h])[0]})" for h in used if h in private and h not in public)
    ctx.record_command(f"#include scan of worker/src, worker/tools, upstream/outreach/examples against {tree}")
    ctx.check("our worker and the examples use llama.cpp through its public headers only (no private src/ header)",
              bool(private) and bool(upstream_used) and not bad,
              ("private headers included: " + ", ".join(bad)) if bad else
              (f"no {tree}/src headers found" if not private else
               f"llama.cpp headers included: {', '.join(upstream_used)} (all public; {len(private)} private src/ "
               f"headers, none included)"))


def _examples_fresh(ctx: StoryContext) -> Path | None:
    """The bin folder of the examples `dgr upstream check` built, when built from this pin and
    series and newer than every example source (nothing is rebuilt here)."""
    import json

    from ...upstream import examples as ex
    from ...upstream import patchstack
    from ...upstream import pin as pin_mod

    bdir = ex.build_dir(ctx.backend)
    stack = patchstack.default_stack()
    pin = pin_mod.load_pin()
    stamp_file = bdir / "dgr-config.json"
    stamp = json.loads(stamp_file.read_text()) if stamp_file.is_file() else {}
    progs = [bdir / "bin" / p for p in (ex.EXAMPLE, *ex.TESTS)]
    sources = [f for f in ex.examples_dir().rglob("*") if f.is_file()]
    problems = []
    if stamp.get("pin") != pin.commit:
        problems.append(f"built for pin {stamp.get('pin')}, the pin is {pin.commit}")
    if stamp.get("patches") != stack.series_digest():
        problems.append(f"built for series {stamp.get('patches')}, the series is {stack.series_digest()}")
    missing = [p.name for p in progs if not p.is_file()]
    if missing:
        problems.append("not built: " + ", ".join(missing))
    elif sources and min(p.stat().st_mtime for p in progs) < max(f.stat().st_mtime for f in sources):
        problems.append("an example source is newer than the built programs")
    try:
        st = patchstack.state(stack, paths.patched_source_dir())
        if st.base != pin.commit or st.dirty or st.unexported or len(st.applied) != len(stack.series()):
            problems.append(f"the patched tree is not the pin + series (base {st.base}, {len(st.applied)} applied, "
                            f"{len(st.dirty)} edit(s), {len(st.unexported)} unexported)")
    except Exception as exc:   # no tree: the build cannot be vouched for
        problems.append(f"patched tree: {exc}")
    ctx.record_command(f"read {stamp_file} and build/llama.cpp state (the build `dgr upstream check` made)")
    ok = ctx.check("the examples are built against the exact pin with the series applied (the build `dgr upstream "
                   "check` made, current)", not problems,
                   "; ".join(problems) or f"{bdir}/bin: {len(progs)} program(s) built for pin {pin.commit[:12]}, series "
                   f"{stack.series_digest()[:19]}, newer than the {len(sources)} example source file(s)")
    return bdir / "bin" if ok else None


def _run_examples(ctx: StoryContext, bin_dir: Path) -> None:
    from ...upstream import examples as ex

    models = ex.synthetic_models(ctx.backend)
    if ctx.model is not None:
        models.append((ctx.model.name, ctx.model))
    ctx.record_command("dgr.upstream.examples.run(" + ", ".join(label for label, _ in models) + ") — as `dgr upstream "
                       "check` runs them, without the build step")
    results = list(ex.run(bin_dir, models, timeout_s=600))
    ctx.results["examples"] = [{"program": r.program, "model": r.model, "ok": r.ok, "seconds": round(r.seconds, 2),
                                "summary": r.summary} for r in results]
    for criterion, programs in CONCERNS:
        rs = [r for r in results if r.program in programs]
        ok = len(rs) == len(programs) * len(models) and all(r.ok for r in rs)
        seen = sorted({r.summary for r in rs if r.ok})
        bad = [f"{r.program} on {r.model}: {r.summary}" for r in rs if not r.ok]
        ctx.check(f"example/test: {criterion}", ok,
                  "; ".join(bad) or f"{len(rs)} run(s) on {len(models)} model(s) ({', '.join(m for m, _ in models)}), "
                  f"all passed: " + " | ".join(seen))


def _outreach(ctx: StoryContext, patches: list) -> None:
    from ...upstream import pin as pin_mod

    out = ctx.tmp / "outreach"
    command_criterion(ctx, "`dgr upstream render` writes the outreach package from the sources and sends nothing",
                      dgr("upstream", "render", "--out", str(out)), needle="nothing was sent: proposing upstream is a "
                                                                           "human action")
    command_criterion(ctx, "the committed render (upstream/outreach/rendered/) is up to date with the sources",
                      dgr("upstream", "render", "--check"), needle="up to date")
    st = ctx.command(["git", "-C", str(paths.repo_root()), "status", "--porcelain", "--", *DERIVED_PATHS])
    if st.returncode == 0 and st.stdout.strip():
        ctx.limitation("The render checked above is not committed yet: `dgr accept --all` renders it from the evidence "
                       "it has just rewritten (the proposal quotes DGR-005, DGR-006 and DGR-010); commit it with the "
                       "evidence.")
    proposal = (out / "proposal.md").read_text() if (out / "proposal.md").is_file() else ""
    pin = pin_mod.load_pin()
    prs = sorted(p.name for p in (out / "pull-requests").glob("*.md")) if (out / "pull-requests").is_dir() else []
    want_prs = [f"{Path(p.file).stem}.md" for p in patches]
    unlinked = [n for n in want_prs if f"(pull-requests/{n})" not in proposal]
    sections = {s: bool(re.search(rf"^## {re.escape(s)}", proposal, re.M))
                for s in ("The generic hooks", "What stays out of llama.cpp", "Why it is useful beyond this project",
                          "How this compares", "Evidence")}
    compared = {name: f"[{name}]({url})" in proposal for name, url in COMPARED}
    explained = {name: f"**{name}**" in proposal for name, _ in COMPARED}
    ex_files = sorted(p.relative_to(out / "examples").as_posix() for p in (out / "examples").rglob("*.cpp")) \
        if (out / "examples").is_dir() else []
    ok = (bool(proposal) and pin.commit in proposal and prs == sorted(want_prs) and not unlinked
          and all(sections.values()) and all(compared.values()) and all(explained.values()) and len(ex_files) >= 6)
    ctx.results["outreach"] = {"proposal_bytes": len(proposal.encode()), "pull_requests": prs, "sections": sections,
                               "compared": compared, "example_sources": ex_files}
    ctx.check("the outreach document names the pin, links one pull-request text per patch, and compares with "
              "Nakshatra and prima.cpp and says why the API is generally useful",
              ok, f"proposal.md {len(proposal.encode())} bytes, pin {'named' if pin.commit in proposal else 'MISSING'}; "
              f"{len(prs)} pull-request text(s) for {len(want_prs)} patch(es)"
              + (f", not linked: {', '.join(unlinked)}" if unlinked else ", all linked")
              + "; sections: " + ", ".join(f"{s} {'yes' if v else 'MISSING'}" for s, v in sections.items())
              + "; compared with a link and a paragraph: " + ", ".join(
                  f"{n} {'yes' if compared[n] and explained[n] else 'MISSING'}" for n, _ in COMPARED)
              + f"; {len(ex_files)} example source(s) in the package; forwarded: "
              + ", ".join(sorted({p.forwarded for p in patches})))
    tests_criterion(ctx, "the rendered text is reproducible and every number in it names its source",
                    [T + "test_upstream_outreach.py::test_render_twice_is_byte_identical",
                     T + "test_upstream_outreach.py::test_every_number_in_the_output_has_a_source",
                     T + "test_upstream_outreach.py::test_a_number_without_a_source_fails_the_render",
                     T + "test_upstream_outreach.py::test_one_pull_request_per_patch_scoped_to_it"])


def _render_for_release() -> str:
    """Under `--all`, DGR-005/006/010 have just rewritten the evidence the proposal quotes: render the
    committed package again so the release commit carries evidence and render together (a named run
    checks the render as committed)."""
    from ...upstream import outreach

    target = outreach.default_out_dir()
    written = outreach.render(target)
    return f"rendered the outreach package from the evidence just written ({len(written)} file(s) in {target})"


@story("DGR-016", "Upstream llama.cpp collaboration package", lane="local-real", needs_model=True,
       all_prep=_render_for_release)
def run(ctx: StoryContext) -> None:
    from ...upstream import patchstack
    from ...upstream import pin as pin_mod

    pin = pin_mod.load_pin()
    stack = patchstack.default_stack()
    ctx.results["pin_commit"] = pin.commit
    ctx.results["patch_series_digest"] = stack.series_digest()
    command_criterion(ctx, "every patch applies at the exact upstream pin without fuzz and re-exports byte-identically",
                      dgr("patches", "verify"), needle=f"{len(stack.series())} patch(es) apply at {pin.commit[:12]}")
    patches = _scoped_patches(ctx)
    tests_criterion(ctx, "the patch stack tooling names a patch that no longer applies, a stale export and a changed "
                         "upstream file",
                    [T + "test_patchstack.py::test_export_apply_verify_roundtrip",
                     T + "test_patchstack.py::test_patch_that_no_longer_applies_is_named",
                     T + "test_patchstack.py::test_stale_patch_detected",
                     T + "test_patchstack.py::test_changed_upstream_assumption"])
    _separation(ctx, patches)
    bin_dir = _examples_fresh(ctx)
    if bin_dir is not None:
        _run_examples(ctx, bin_dir)
    _outreach(ctx, patches)
    ctx.limitation("The examples are not rebuilt by this story: it runs the programs `dgr upstream check` built in "
                   "build/outreach-<backend>/ and fails when that build is not of this pin and series (run `dgr upstream "
                   "check` to rebuild); the build itself is covered by "
                   "tests/test_upstream_outreach.py::test_upstream_check_builds_and_passes_on_synthetic_models.")
    ctx.limitation("The comparison with Nakshatra and prima.cpp is the proposal's reading of their public repositories "
                   "and design notes (cited by link); neither project was built or measured here. The figures the "
                   "proposal prints come from this project's own evidence (DGR-005, DGR-006, DGR-010).")
    ctx.limitation("Nothing was sent to llama.cpp: the package is files only; proposing the patches upstream is a "
                   "human action.")
