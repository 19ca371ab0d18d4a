"""The README.md of an evidence folder and the verdict it states (see :mod:`dgr.accept.evidence`)."""

from __future__ import annotations

from typing import Any


def verdict_of(criteria_met: bool, decision: str | None) -> str:
    """PASS/FAIL against the criteria; a story that ended in a decision has the decision as its
    verdict, but only when its run held (a run with a failed criterion is a FAIL whatever it decided)."""
    if not criteria_met:
        return "FAIL"
    return decision or "PASS"


def story_readme(st: Any, ctx: Any, ok: bool, env: dict, elapsed: float, error: str | None) -> str:
    """The README.md of a story's evidence folder (``st``: its Story, ``ctx``: the StoryContext it ran in)."""
    lines = [
        f"# {st.story_id}: {st.title}",
        "",
        f"Written by `dgr accept {st.story_id}` — do not edit by hand; re-run the command instead.",
        "",
    ]
    if env.get("git_dirty"):
        lines += [f"> **Dirty tree**: this run's tree at {env.get('git_commit')} had uncommitted changes "
                  f"({', '.join(env.get('git_dirty_paths') or [])}); these results are not tied to a commit.", ""]
    lines += [
        f"- **Verdict: {verdict_of(ok, ctx.decision)}**"
        + (f" (the decision this story ends in; {ctx.decision_text})" if ctx.decision and ok else ""),
    ]
    if ctx.decision:
        met = sum(c.passed for c in ctx.checks)
        lines.append(f"- The run held: {'yes' if ok else 'no'}, {met} of {len(ctx.checks)} criteria met "
                     + ("(the decision above is the story's verdict)" if ok else
                        f"(a run that did not hold decides nothing; it had reached {ctx.decision})"))
    lines += [
        f"- Lane: {st.lane}",
        f"- Ran: {env['timestamp_utc']} on {env['host']} ({env['cpu']}, {env['cpu_count']} CPUs), "
        f"backend {env['backend']}" + (f" (device {env['device']})" if env.get("device") else "") + f", {elapsed:.0f}s"
        + (f"; load average at start {'/'.join(f'{x:.2f}' for x in env['load_average_at_start'])} (1/5/15 min)"
           if env.get("load_average_at_start") else ""),
        f"- llama.cpp pin {env['pin_commit']}, patch series {env['patch_series_digest']}, dgr {env['dgr_version']}",
        f"- dgr commit {env.get('git_commit') or 'not recorded'}" + (" (dirty tree)" if env.get("git_dirty") else ""),
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
