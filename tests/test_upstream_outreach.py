"""`dgr upstream render` / `check`: the collaboration package for llama.cpp maintainers."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dgr.upstream import patchstack
from dgr.errors import DgrError
from dgr.main import app
from dgr.upstream import outreach

runner = CliRunner()


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_render_twice_is_byte_identical(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    outreach.render(a)
    outreach.render(b)
    fa, fb = _files(a), _files(b)
    assert fa == fb
    assert "proposal.md" in fa and "README.md" in fa and "examples/README.md" in fa


def test_committed_render_is_up_to_date():
    # upstream/outreach/rendered/ is committed for maintainers to read; it must match the sources
    assert outreach.differences() == [], "run `dgr upstream render` and commit the result"


def test_one_pull_request_per_patch_scoped_to_it(tmp_path):
    outreach.render(tmp_path)
    series = patchstack.default_stack().series()
    prs = sorted(p.name for p in (tmp_path / "pull-requests").iterdir())
    assert prs == sorted(Path(n).stem + ".md" for n in series)
    pin = outreach.pin_mod.load_pin()
    for patch in outreach.read_series():
        text = (tmp_path / "pull-requests" / f"{patch.slug}.md").read_text()
        assert text.startswith(f"# {patch.subject}\n")
        assert pin.commit in text and f"git am {patch.file}" in text
        # its own files with their line counts, nobody else's patch file
        for f in patch.files:
            assert f"| `{f.path}` | {f.added} | {f.removed} |" in text
        for other in series:
            if other != patch.file:
                assert other not in text


def test_every_number_in_the_output_has_a_source(tmp_path):
    outreach.render(tmp_path)
    figures = outreach.load_figures()
    proposal = (tmp_path / "proposal.md").read_text()
    # each figure printed in the proposal carries its evidence file and JSON pointer
    printed = [f for f in figures.values() if f"{f.text} (`{f.source}`)" in proposal or
               f"| {f.text} | `{f.source}` |" in proposal]
    assert len(printed) >= 20
    for f in printed:
        assert (outreach.paths.repo_root() / f.file).is_file()
    assert "## Where the numbers come from" in proposal


@pytest.mark.parametrize("inject, expected", [
    ("We measured 42 MiB here.\n", "'42'"),
    ("Resident: `61.3 MiB`.\n", "bare number in a code span"),
    ("{{ fig('no_such_figure') }}\n", "no_such_figure"),
])
def test_a_number_without_a_source_fails_the_render(tmp_path, inject, expected):
    templates = tmp_path / "templates"
    shutil.copytree(outreach.templates_dir(), templates)
    with open(templates / "prose" / "evidence.md.j2", "a") as f:
        f.write(inject)
    with pytest.raises(DgrError, match=re.escape(expected)):
        outreach.build_documents(templates=templates)


def test_audit_allows_sourced_numbers_code_and_links():
    prov = outreach.Provenance({})
    text = (f"Patch `0001` changes {prov.stat(12, 'x.patch')} lines, see "
            f"{prov.ref('llama.cpp#13106', 'https://github.com/ggml-org/llama.cpp/pull/13106')} and "
            "[the pin](https://example.org/v2/3) and `llama_decode() == -1`.\n"
            "```c\nint32_t layer_end = 30;\n```\n")
    assert outreach.audit(text, "t") == []
    assert outreach.audit("about 7 layers\n", "t") == ["t:1: number '7' without a source: 'about 7 layers'"]


def test_figures_read_values_from_evidence(tmp_path):
    ev = tmp_path / "evidence" / "X" / "results.json"
    ev.parent.mkdir(parents=True)
    ev.write_text('{"metrics": {"a/b": {"0:15": {"rss_bytes": 104857600}}, "ok": true, "r": [[0, 15], [15, 30]]}}')
    manifest = tmp_path / "figures.toml"
    manifest.write_text(
        '[[figure]]\nid = "rss"\nlabel = "RSS"\nfile = "evidence/X/results.json"\n'
        'pointer = "/metrics/a~1b/0:15/rss_bytes"\nformat = "mib"\n'
        '[[figure]]\nid = "ok"\nfile = "evidence/X/results.json"\npointer = "/metrics/ok"\nformat = "bool"\n'
        '[[figure]]\nid = "r"\nfile = "evidence/X/results.json"\npointer = "/metrics/r"\nformat = "ranges"\n')
    figs = outreach.load_figures(manifest, root=tmp_path)
    assert figs["rss"].text == "100.0 MiB"
    assert figs["rss"].source == "evidence/X/results.json#/metrics/a~1b/0:15/rss_bytes"
    assert figs["ok"].text == "true" and figs["r"].text == "0:15, 15:30"


@pytest.mark.parametrize("pointer, fmt, message", [
    ("/metrics/missing", "int", "has no value at /metrics/missing"),
    ("/metrics/ok", "mib", "format mib needs a number"),
    ("/metrics/n", "bool", "format bool needs true or false"),
])
def test_a_figure_that_cannot_be_read_is_an_error(tmp_path, pointer, fmt, message):
    ev = tmp_path / "results.json"
    ev.write_text('{"metrics": {"ok": true, "n": 3}}')
    manifest = tmp_path / "figures.toml"
    manifest.write_text(f'[[figure]]\nid = "f"\nfile = "results.json"\npointer = "{pointer}"\nformat = "{fmt}"\n')
    with pytest.raises(DgrError, match=re.escape(message)):
        outreach.load_figures(manifest, root=tmp_path)


def test_read_patch_takes_the_description_apart():
    patches = outreach.read_series()
    first = patches[0]
    assert first.number == "0001" and first.subject == "llama : load a model by layer range"
    assert first.upstreamable.startswith("possibly") and first.forwarded == "no"
    assert "Upstreamable" not in first.reason and first.reason.startswith("Add llama_model_params.layer_start")
    assert "        int32_t layer_start;" in first.api and "+        int32_t layer_start;" in first.api_diff
    assert {f.path for f in first.files} >= {"include/llama.h", "src/llama-model.cpp"}
    # a subject folded over two lines by format-patch is read as one line
    assert patches[2].subject == "llama : take the input of a model without token embedding as embeddings"


def test_cli_render_errors_are_one_line(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    res = runner.invoke(app, ["upstream", "render", "--out", str(afile)])
    assert res.exit_code == 1 and isinstance(res.exception, DgrError)
    assert "exists and is not a folder" in str(res.exception)
    res = runner.invoke(app, ["upstream", "render", "--check", "--out", str(tmp_path / "empty")])
    assert res.exit_code == 1 and "not up to date" in str(res.exception)


def test_cli_render_writes_and_says_nothing_was_sent(tmp_path):
    res = runner.invoke(app, ["upstream", "render", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "proposal.md" in res.output and "nothing was sent" in res.output
    assert runner.invoke(app, ["upstream", "render", "--check", "--out", str(tmp_path)]).exit_code == 0


@pytest.mark.native
def test_upstream_check_builds_and_passes_on_synthetic_models(native_bin, monkeypatch):
    from dgr.upstream import examples

    monkeypatch.delenv(examples.REAL_ENV, raising=False)   # the synthetic models only
    res = runner.invoke(app, ["upstream", "check", "-j", "2", "--timeout", "300"])
    assert res.exit_code == 0, res.output + str(res.exception)
    runs = len(examples.SYNTH_MODELS) * (1 + len(examples.TESTS))
    lines = [ln for ln in res.output.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert len(lines) == runs and all(ln.startswith("PASS") for ln in lines), res.output
    for program in (examples.EXAMPLE, *examples.TESTS):
        assert sum(f" {program} " in ln for ln in lines) == len(examples.SYNTH_MODELS)
    assert sum("split-simple: PASS" in ln for ln in lines) == len(examples.SYNTH_MODELS)
    assert f"all {runs} example/test runs passed" in res.output
