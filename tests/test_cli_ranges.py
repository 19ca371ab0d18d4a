"""CLI values are range-checked by Typer: every int/float option and argument of every command
has a lower bound (counts, threads, ports, timeouts, seeds, sizes; the exception list below is
empty and must name a reason for each entry), and a value out of range ends in one line on
stderr, exit code 2, no traceback, before any work starts."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest
import typer

from dgr.main import app

# "command path --option" -> why it may go unbounded (none today).
UNBOUNDED: dict[str, str] = {}


def _base(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return _base(args[0]) if args else annotation


def numeric_params() -> list[tuple[str, typing.Any]]:
    out = []

    def walk(cmd, path: str) -> None:
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, f"{path} {name}")
        for p in getattr(cmd, "params", []):
            if _base(p.type_descriptor.annotation) in (int, float):
                out.append((f"{path} {p.opts[0] if p.opts else p.name}", p))

    walk(typer.main.get_command(app), "dgr")
    return out


def test_every_numeric_option_has_a_lower_bound() -> None:
    params = numeric_params()
    assert len(params) >= 60  # the walk really reaches every command group
    unbounded = sorted(name for name, p in params if p.min is None and name not in UNBOUNDED)
    assert not unbounded, f"int/float options without a lower bound (add min=, or list them with a reason): {unbounded}"
    stale = sorted(set(UNBOUNDED) - {name for name, _ in params})
    assert not stale, f"UNBOUNDED names options that no longer exist: {stale}"


def test_bounds_match_what_the_values_mean() -> None:
    bounds = {name: (p.min, p.max) for name, p in numeric_params()}
    assert bounds["dgr serve --port"] == (0, 65535)
    assert bounds["dgr worker serve --max-sessions"] == (1, 256)  # the worker's own limit
    assert bounds["dgr route run --top-p"] == (0.0, 1.0)
    assert bounds["dgr lab up --loss"][1] < 1  # a probability in [0, 1)
    zero_is_default = {"dgr drill --max-tokens"}  # 0: the drill's own default per mode
    for name, (lo, _hi) in bounds.items():
        if name.endswith(("--threads", "--repeats", "--max-tokens", "--n-prompt", "--n-gen", "--jobs")):
            assert lo == (0 if name in zero_is_default else 1), name


def _dgr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgr.main", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, option, bound", [
    (["route", "generate", "--max-tokens", "0", "--prompt", "hi"], "--max-tokens", "greater than or equal to 1"),
    (["route", "run", "--sessions", "-3"], "--sessions", "greater than or equal to 0"),
    (["route", "run", "--top-p", "1.5"], "--top-p", "less than or equal to 1"),
    (["route", "generate", "--seed", "-1", "--prompt", "hi"], "--seed", "greater than or equal to 0"),
    (["bench", "worker", "--threads", "0"], "--threads", "greater than or equal to 1"),
    (["bench", "route", "--repeats", "0"], "--repeats", "greater than or equal to 1"),
    (["serve", "--port", "70000"], "--port", "less than or equal to 65535"),
    (["worker", "serve", "--fake-model", "--max-sessions", "100000"], "--max-sessions", "less than or equal to 256"),
    (["worker", "serve", "--fake-model", "--drain-timeout-s", "-1"], "--drain-timeout-s", "greater than or equal to 0"),
    (["gguf", "synth", "--layers", "0", "--out", "out.gguf"], "--layers", "greater than or equal to 1"),
    (["lab", "up", "--loss", "1"], "--loss", "less than or equal to 0.999"),
])
def test_out_of_range_values_are_one_line_errors(args: list[str], option: str, bound: str, tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "dgr.main", *args], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("dgr: error: Invalid value for") and option in lines[0] and bound in lines[0], lines[0]
    assert "--help" in lines[0] and "Traceback" not in r.stderr + r.stdout
    assert not list(tmp_path.iterdir())  # refused before any work


def test_other_usage_errors_are_one_line_too_and_help_still_works() -> None:
    r = _dgr("route", "generate", "--no-such-option")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "dgr: error: No such option: --no-such-option (see 'dgr route generate --help')"]
    r = _dgr("route", "generate", "--help")
    assert r.returncode == 0 and "--max-tokens" in r.stdout and "x>=1" in r.stdout
    r = _dgr("route")  # a bare group shows its help, as before
    assert r.returncode == 2 and "Usage" in r.stdout + r.stderr


@pytest.mark.parametrize("layers, why", [("5:2", "need 0 <= START < END"), ("a:b", "write START:END"),
                                          ("0:99", "outside the model's 2 layers")])
def test_layer_ranges_are_checked_in_one_line(layers: str, why: str, tmp_path) -> None:
    from dgr.gguf.synth import SynthSpec, synthesize

    model = synthesize(SynthSpec(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64), tmp_path / "m.gguf")
    r = _dgr("gguf", "slice", str(model), f"--layers={layers}", "--out", str(tmp_path / "s.gguf"))
    last = r.stderr.strip().splitlines()[-1]  # after any progress lines
    assert r.returncode == 1 and last.startswith("dgr: error: ") and why in last, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "s.gguf").exists()
