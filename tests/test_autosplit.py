"""`--split auto` on local workers (`dgr route run`, `dgr serve`): this machine probes the model and
the planner chooses. One machine shares its cores and memory among its workers, so the plan keeps
the model whole when it fits, and refuses (naming the figures) when it does not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dgr.errors import DgrError

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from dgr.gguf.synth import SynthSpec, synthesize

    return synthesize(SynthSpec(n_layer=6, dtype="q8_0"), tmp_path_factory.mktemp("auto") / "m.gguf")


@pytest.fixture
def worker(monkeypatch, native_bin):
    monkeypatch.setenv("DGR_WORKER_BIN", str(native_bin / "dgr-worker"))
    monkeypatch.setattr("dgr.route.local.ensure_worker", lambda *a, **k: native_bin / "dgr-worker")


def test_one_machine_keeps_the_model_whole(synth, worker, caplog):
    import logging

    from dgr.route.autosplit import plan_local

    with caplog.at_level(logging.INFO, logger="dgr.route.autosplit"):
        auto = plan_local(synth, 4, threads=1)
    assert auto.ranges == [(0, 6)] and auto.placement is None and auto.groups == 1
    assert auto.worker_args() == ()
    assert "probe on this machine" in caplog.text
    text = auto.describe(4)[0]
    assert text.startswith("plan: 0:6 on this machine, 1 pipeline group(s); predicted ") and "at 4 session(s)" in text
    assert auto.plan["prediction"]["aggregate_tok_s"] > 0


def test_a_model_larger_than_this_machine_is_refused(synth, worker, monkeypatch):
    from dgr.route import probe
    from dgr.route.autosplit import plan_local

    monkeypatch.setattr(probe, "host_memory_bytes", lambda *_a: 1 << 20)   # 1 MiB free
    with pytest.raises(DgrError) as e:
        plan_local(synth, 1, threads=1)
    assert e.value.one_line().startswith("--split auto: ") and "several machines" in (e.value.hint or "")


def test_route_run_split_auto_end_to_end(synth, worker):
    from typer.testing import CliRunner

    from dgr.main import app

    r = CliRunner().invoke(app, ["route", "run", "--model", str(synth), "--split", "auto", "--threads", "1",
                                 "--prompt", "hello", "--raw", "--max-tokens", "3", "--json"])
    assert r.exit_code == 0, r.output
    assert "plan: 0:6 on this machine" in r.output


@pytest.mark.parametrize("args, message", [
    (["route", "run", "--split", "auto", "--fake"], "fake model has none"),
    (["route", "run", "--split", "auto", "--backend", "cpu,cpu"], "one backend"),
    (["serve", "--port", "0", "--split", "auto", "--fake"], "fake model has none"),
])
def test_split_auto_refusals_in_one_line(args, message):
    p = subprocess.run([sys.executable, "-c", "from dgr.main import main; main()", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
