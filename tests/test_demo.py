"""`dgr demo`: the summary table and the whole-model llama.cpp yardstick (synthetic, no processes),
and the demo end to end on the embedded SmolLM2 (real lane)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgr.route import local, report, sessions
from dgr.route import run as route_run
from dgr.errors import DgrError
from dgr.route.llama_whole import WholeLlama, WholeRow

LLAMA_1 = "llama.cpp (llama-batched-bench) 1 session"
LLAMA_AGG = "llama.cpp (llama-batched-bench) aggregate (4)"
LLAMA_PER = "llama.cpp (llama-batched-bench) per session (4)"
SERVER_1 = "llama.cpp (llama-server) 1 session"
SERVER_AGG = "llama.cpp (llama-server) aggregate (4)"
NOT_MEASURED = "llama.cpp baseline: not measured ("


# ---- synthetic reports ---------------------------------------------------------------------

def _session(i: int, *, prompt_tokens: int = 20, n: int = 8, ttft: float = 0.1) -> sessions.SessionReport:
    toks = [100 + i + k for k in range(n)]
    return sessions.SessionReport(
        index=i, prompt=f"p{i}", prompt_tokens=prompt_tokens, tokens=toks, text="x" * n, finish_reason="length",
        status="ok", error=None, ttft_s=ttft, prefill_tok_s=200.0, decode_tok_s=50.0, decode_start_s=ttft,
        decode_end_s=ttft + 0.2, seam_bytes_per_decode_token=[2400.0], hop_decode_rtt_s=[0.01, 0.01],
        telemetry={}, top_logprobs=[[(t, -0.1), (t + 1, -3.0)] for t in toks],
        token_times_s=[ttft + 0.025 * k for k in range(n)])


def _report(label: str, ranges: list[str], n: int = 4, **kw) -> sessions.RunReport:
    workers = []
    for r in ranges:
        w = sessions.WorkerStats(r, "127.0.0.1:1", 1, rss_peak_bytes=150_000_000, kv_cells_total=8192, kv_cells_peak=120,
                           kv_bytes_per_cell=46_080, batches=10, batch_rows=30)
        workers.append(w)
    return sessions.RunReport(label, [f"127.0.0.1:1[{r})" for r in ranges], [_session(i, **kw) for i in range(n)], 1.0,
                        workers, mode="chained")


WHOLE = WholeLlama(
    command=["/b/llama-batched-bench", "-m", "/m.gguf", "-c", "528", "-b", "512", "-ub", "512", "-npp", "20",
             "-ntg", "48", "-npl", "1,4", "-t", "2", "--output-format", "jsonl"],
    rows=[WholeRow(1, 0.0812, 310.0, 95.5, 95.5, 68 * 184_320),
          WholeRow(4, 0.2734, 350.0, 180.0, 45.0, 272 * 184_320)],
    peak_rss_bytes=210_000_000, wall_s=12.0)

SERVER = WholeLlama(
    command=["/b/llama-server", "-m", "/m.gguf", "-t", "2", "-tb", "2", "-np", "4", "-c", "4096", "-b", "512",
             "-ub", "512", "--host", "127.0.0.1", "--port", "1234", "--no-webui"],
    rows=[WholeRow(1, 0.0712, 290.0, 92.5, 92.5, 70 * 184_320),
          WholeRow(4, 0.2034, 330.0, 170.0, 42.5, 280 * 184_320)],
    peak_rss_bytes=220_000_000, wall_s=14.0, tool="llama-server")


def _run(**kw) -> report.RouteRun:
    return report.RouteRun(_report("route 0:15,15:30", ["0:15", "15:30"]), _report("whole model 0:30", ["0:30"]),
                       None, [(0, 15), (15, 30)], "/m.gguf", **kw)


def _row(table: str, label: str) -> list[str]:
    line = next(ln for ln in table.splitlines() if ln.startswith(label))
    return line[len(label):].split()


# ---- summary table -------------------------------------------------------------------------

def test_summary_table_has_llama_rows_next_to_route_and_whole_worker():
    table = report.summary_table(_run(llama=WHOLE))
    assert _row(table, LLAMA_1) == ["81", "310", "95.5"]
    assert _row(table, LLAMA_AGG) == ["273", "350", "180.0"]
    assert _row(table, LLAMA_PER) == ["273", "88", "45.0"]          # prefill 350 / 4
    # the old rows stay; the dgr-worker whole model is labelled as such
    assert "route  session 3" in table and "route  aggregate" in table
    assert "whole model on 1 dgr-worker  session 0" in table and "whole model on 1 dgr-worker  aggregate" in table
    assert "whole 1 dgr-worker [0:30)" in table and "route [15:30)" in table
    # memory part: the child's peak RSS and the KV its 4 sequences held
    assert _row(table, "llama-batched-bench (4)")[:4] == ["210.0", "MB", f"{272 * 184_320 / 1e6:.1f}", "MB"]
    # footnote: the yardstick runs synthetic equal-length prompts in lockstep
    flat = " ".join(table.split())
    assert "lockstep" in flat and "equal-length prompts" in flat and "synthetic tokens" in flat
    assert "-t 2" in flat and "20-token prompts" in flat and "48 tokens generated" in flat
    assert NOT_MEASURED not in table
    assert max(len(ln) for ln in table.splitlines()) <= 100, table


def test_summary_table_llama_server_rows_and_note():
    table = report.summary_table(_run(llama=SERVER))
    assert _row(table, SERVER_1) == ["71", "290", "92.5"]
    assert _row(table, SERVER_AGG) == ["203", "330", "170.0"]
    assert _row(table, "llama-server (4)")[:4] == ["220.0", "MB", f"{280 * 184_320 / 1e6:.1f}", "MB"]
    flat = " ".join(table.split())
    assert "llama-server at the pin" in flat and "same chat prompts" in flat and "-np 4" in flat and "-t 2" in flat
    assert "lockstep" not in flat and "llama-batched-bench" not in flat
    assert max(len(ln) for ln in table.splitlines()) <= 100, table
    assert _run(llama=SERVER).to_json()["llama"]["tool"] == "llama-server"


def test_summary_table_says_when_the_baseline_was_not_measured():
    table = report.summary_table(_run(llama_error="llama-batched-bench failed (exit 1): error: unknown argument -npp"))
    assert f"{NOT_MEASURED}llama-batched-bench failed (exit 1): error: unknown argument -npp)" in table
    assert "llama.cpp (llama-batched-bench)" not in table and "llama-batched-bench (" not in table
    assert "whole model on 1 dgr-worker  aggregate" in table
    long = report.summary_table(_run(llama_error="ninja failed (exit 1); last lines:\n" + "x " * 400))
    assert NOT_MEASURED + "ninja failed" in long and max(len(ln) for ln in long.splitlines()) <= 100
    # not asked for: no line at all
    assert "llama.cpp" not in report.summary_table(_run())


def test_route_run_json_carries_the_baseline():
    doc = _run(llama=WHOLE).to_json()
    assert doc["llama"]["tool"] == "llama-batched-bench" and [r["sessions"] for r in doc["llama"]["rows"]] == [1, 4]
    assert doc["llama_error"] is None
    doc = json.loads(json.dumps(_run(llama_error="boom").to_json()))
    assert doc["llama"] is None and doc["llama_error"] == "boom"


# ---- run_local: when and how the baseline is measured ---------------------------------------

@pytest.fixture
def fake_local(monkeypatch):
    """run_local without processes: LocalRoute and run_sessions stand-ins that log events."""
    events: list[tuple] = []

    class FakeRoute:
        def __init__(self, model, split, **kw):
            self.split, self.kw, self.workers = list(split), kw, []
            events.append(("threads", kw.get("threads")))

        def __enter__(self):
            events.append(("start", tuple(self.split)))
            return self

        def __exit__(self, *exc):
            events.append(("stop", tuple(self.split)))

        @property
        def endpoints(self):
            return [f"127.0.0.1:{i}" for i in range(len(self.split))]

        def stats(self):
            return []

    async def fake_sessions(endpoints, prompts, *, label="route", max_tokens=32, **kw):
        events.append(("sessions", label))
        lengths = [18, 19, 22, 27]
        return sessions.RunReport(label, list(endpoints),
                            [_session(i, prompt_tokens=lengths[i % 4], n=max_tokens) for i in range(len(prompts))],
                            1.0, mode="chained")

    calls: list[dict] = []

    def fake_measure(model, **kw):
        events.append(("llama",))
        calls.append(dict(kw, model=model))
        if isinstance(fake_measure.result, Exception):
            raise fake_measure.result
        return fake_measure.result

    fake_measure.result = SERVER
    monkeypatch.setattr(route_run, "LocalRoute", FakeRoute)
    monkeypatch.setattr(route_run, "run_sessions", fake_sessions)
    monkeypatch.setattr("dgr.route.llama_whole.measure_whole_llama_server", fake_measure)
    return events, calls, fake_measure


def test_run_local_measures_llama_after_every_worker_stopped(fake_local, caplog):
    events, calls, _ = fake_local
    caplog.set_level("INFO", logger="dgr.route.run")
    res = route_run.run_local(Path("/m.gguf"), [(0, 15), (15, 30)], list(sessions.DEFAULT_PROMPTS), max_tokens=12, parity=True,
                       llama_baseline=True)
    logs = caplog.messages
    assert res.llama is SERVER and res.llama_error is None and res.parity.ok
    # the same prompts, answer length and threads as the route
    assert calls == [dict(model=Path("/m.gguf"), threads=os.cpu_count(), prompts=list(sessions.DEFAULT_PROMPTS),
                          max_tokens=12, sessions=(1, 4), backend="cpu")]
    assert events[-1] == ("llama",)                              # after the route and whole-worker runs
    assert events.count(("stop", ((0, 15), (15, 30)))) == 1 and events.count(("stop", ((0, 30),))) == 1
    assert {e[1] for e in events if e[0] == "threads"} == {os.cpu_count()}
    assert any("llama-server -np 4" in m and "-t " in m for m in logs)
    assert "llama" in res.to_json() and res.to_json()["llama"]["rows"][1]["sessions"] == 4


def test_run_local_passes_the_workers_threads(fake_local):
    events, calls, _ = fake_local
    route_run.run_local(Path("/m.gguf"), [(0, 15), (15, 30)], ["a", "b"], max_tokens=5, parity=True, threads=3,
                 llama_baseline=True)
    assert calls[0]["threads"] == 3 and calls[0]["sessions"] == (1, 2) and calls[0]["prompts"] == ["a", "b"]
    assert {e[1] for e in events if e[0] == "threads"} == {3}


def test_run_local_without_baseline_does_not_measure(fake_local):
    _, calls, _ = fake_local
    res = route_run.run_local(Path("/m.gguf"), [(0, 15), (15, 30)], ["a"], max_tokens=4, parity=True)
    assert calls == [] and res.llama is None and res.llama_error is None
    assert "llama.cpp" not in report.summary_table(res)


def test_a_failing_baseline_is_recorded_and_printed_not_raised(fake_local, caplog):
    _, calls, measure = fake_local
    measure.result = DgrError("llama-server exited (1): error: unknown argument --no-webui")
    caplog.set_level("INFO", logger="dgr.route.run")
    res = route_run.run_local(Path("/m.gguf"), [(0, 15), (15, 30)], ["a", "b"], max_tokens=4, parity=True,
                       llama_baseline=True)
    logs = caplog.messages
    assert res.llama is None and res.llama_error == "llama-server exited (1): error: unknown argument --no-webui"
    assert f"{NOT_MEASURED}llama-server exited (1): error: unknown argument --no-webui)" in report.summary_table(res)
    assert any("not measured" in m for m in logs)
    measure.result = FileNotFoundError(2, "No such file or directory")
    res = route_run.run_local(Path("/m.gguf"), [(0, 15), (15, 30)], ["a"], max_tokens=4, parity=True, llama_baseline=True)
    assert res.llama is None and "No such file" in res.llama_error


def test_a_tool_that_cannot_be_built_is_not_measured(monkeypatch):
    def no_build(name, backend="cpu", **kw):
        raise DgrError("cmake failed (exit 1)", hint="install a C++ toolchain")

    monkeypatch.setattr("dgr.upstream.build.tool_binary", no_build)
    monkeypatch.setattr("dgr.route.local.model_n_layer", lambda m: 30)
    got, err = route_run.whole_llama_baseline(Path("/m.gguf"), threads=2, prompts=["a"], max_tokens=8, sessions=(1, 4))
    assert got is None and err == "cmake failed (exit 1) (install a C++ toolchain)"
    assert route_run.whole_llama_baseline(None, threads=2, prompts=["a"], max_tokens=8, sessions=(1,)) == \
        (None, "no GGUF model (fake-model workers)")


def test_demo_asks_for_the_baseline_and_survives_its_failure(monkeypatch):
    from typer.testing import CliRunner

    from dgr.main import app

    seen: dict = {}

    def fake_run_local(model, split, prompts, **kw):
        seen.update(kw)
        return _run(llama_error="llama-batched-bench failed (exit 1): boom")

    monkeypatch.setattr("dgr.gguf.models.resolve_model", lambda m: Path("/m.gguf"))
    monkeypatch.setattr(local, "model_n_layer", lambda m: 30)
    monkeypatch.setattr(local, "ensure_worker", lambda **kw: Path("/w"))
    monkeypatch.setattr(route_run, "run_local", fake_run_local)
    r = CliRunner().invoke(app, ["demo", "--max-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert seen["llama_baseline"] is True and seen["parity"] is True and seen["max_tokens"] == 8
    assert f"{NOT_MEASURED}llama-batched-bench failed (exit 1): boom)" in r.output


# ---- real lane -----------------------------------------------------------------------------

@pytest.mark.real
@pytest.mark.native
def test_demo_runs_to_completion_with_parity_and_table(smollm2_path, native_bin, tmp_path):
    out = tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "dgr.main", "demo", "--max-tokens", "16", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "greedy parity vs whole model: OK" in p.stdout and "concurrent isolation: OK" in p.stdout
    for col in ("TTFT ms", "prefill tok/s", "decode tok/s", "route  aggregate", "whole model on 1 dgr-worker  aggregate",
                "seam bytes per decode token", "KV peak", SERVER_1, SERVER_AGG, "llama-server (4)"):
        assert col in p.stdout, col
    # the footnote is wrapped to the table's width: compare its words, not its line breaks
    assert "same chat prompts" in " ".join(p.stdout.split())
    assert NOT_MEASURED not in p.stdout
    assert p.stdout.count("assistant:") == 4
    doc = json.loads(out.read_text())
    assert doc["parity"]["ok"] and len(doc["route"]["sessions"]) == 4
    assert [w["range"] for w in doc["route"]["workers"]] == ["0:15", "15:30"]
    assert all(w["rss_peak_bytes"] > 0 and w["kv_cells_peak"] > 0 for w in doc["route"]["workers"])
    assert 0 < doc["route"]["seam_bytes_per_decode_token"] <= 2 * 576 * 4 + 256
    # stock llama-server at the route's threads serving the same prompts, 1 and 4 sessions
    assert doc["llama_error"] is None
    llama = doc["llama"]
    cmd = llama["command"]
    assert llama["tool"] == "llama-server"
    assert cmd[cmd.index("-t") + 1] == str(os.cpu_count()) and cmd[cmd.index("-np") + 1] == "4"
    assert [r["sessions"] for r in llama["rows"]] == [1, 4] and llama["peak_rss_bytes"] > 0
    assert all(r["ttft_s"] > 0 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["kv_bytes"] > 0
               for r in llama["rows"])


@pytest.mark.real
@pytest.mark.native
def test_demo_runs_gemma3_270m(gemma3_path, native_bin, tmp_path):
    """`dgr demo --model gemma3-270m`: the packaged Gemma 3 split in halves, greedy parity OK."""
    out = tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "dgr.main", "demo", "--model", "gemma3-270m", "--max-tokens", "12",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "greedy parity vs whole model: OK" in p.stdout and "concurrent isolation: OK" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["parity"]["ok"] and [w["range"] for w in doc["route"]["workers"]] == ["0:9", "9:18"]
    assert Path(doc["model"]) == gemma3_path
    assert 0 < doc["route"]["seam_bytes_per_decode_token"] <= 2 * 640 * 4 + 256


def test_summary_table_names_each_workers_device_and_its_vram():
    run = _run(llama=WHOLE)
    run.route.workers[0].device_class = "cpu"
    run.route.workers[1].device_class, run.route.workers[1].device_memory_bytes = "cuda:sm_90", 812_300_000
    table = report.summary_table(run)
    flat = " ".join(table.split())
    assert "devices: [0:15) cpu, [15:30) cuda:sm_90 812.3 MB VRAM, [0:30) ?" in flat
    assert max(len(ln) for ln in table.splitlines()) <= 100, table
    js = run.to_json()["route"]["workers"][1]
    assert js["device_class"] == "cuda:sm_90" and js["device_memory_bytes"] == 812_300_000
