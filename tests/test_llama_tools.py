"""dgr.bench.llama_tools: the one wrapper for llama-bench / llama-batched-bench. Parsing is
checked on outputs recorded from the pinned tools; running on stand-in executables (exit codes,
deadline, peak RSS, the command line each caller gets); and once on the real tools of this
build, which must print what the parsers and the recorded outputs expect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from built import built

from dgr.bench import llama_tools as lt
from dgr.errors import DgrError

FIX = Path(__file__).parent / "fixtures" / "llama_tools"
LB = (FIX / "llama-bench.json").read_text()
BB = (FIX / "llama-batched-bench.jsonl").read_text()


def test_llama_bench_rows_from_recorded_output():
    rows = lt.parse_llama_bench(LB)
    assert len(rows) == 2
    pp, tg = rows
    assert pp.is_prefill and not pp.is_decode and (pp.n_prompt, pp.n_gen, pp.n_depth) == (8, 0, 0)
    assert tg.is_decode and (tg.n_prompt, tg.n_gen) == (0, 4)
    assert pp.avg_ts == pytest.approx(37983.822511) and pp.stddev_ts == pytest.approx(4931.275026)
    assert tg.avg_ts == pytest.approx(15983.066255)


def test_llama_bench_text_before_the_array_is_skipped_and_garbage_is_an_error():
    assert lt.parse_llama_bench("build: 1234\n" + LB)[0].n_prompt == 8
    with pytest.raises(DgrError, match="no JSON rows"):
        lt.parse_llama_bench("error: no model\n")
    with pytest.raises(DgrError, match="malformed JSON"):
        lt.parse_llama_bench("[{\"avg_ts\": ")


def test_batched_bench_rows_from_recorded_output_skip_log_lines():
    rows = lt.parse_batched_bench(BB)
    assert sorted(rows) == [1, 2]
    one, two = rows[1], rows[2]
    assert (one.pp, one.tg, one.n_kv) == (8, 4, 12) and two.n_kv == 24
    assert one.speed_tg == pytest.approx(11235.955078) and two.speed_pp == pytest.approx(37383.175781)
    assert two.speed == pytest.approx(29999.998047) and one.t_pp == pytest.approx(0.000803)
    assert lt.parse_batched_bench("no rows here\n") == {}


def _tool(tmp_path: Path, name: str, body: str) -> Path:
    exe = tmp_path / name
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    return exe


def test_batched_bench_runs_measures_and_renders_the_command(tmp_path):
    out = tmp_path / "out"
    out.write_text(BB)
    args = tmp_path / "args"
    exe = _tool(tmp_path, "llama-batched-bench", f'echo "$@" > {args}\ncat {out}\n')
    log = lt.CommandLog()
    rows, m = lt.batched_bench(exe, Path("/m.gguf"), threads=3, n_prompt=8, n_gen=4, npl=[1, 2], ctx=300,
                               batch=2048, gpu_layers="0", log=log)
    assert sorted(rows) == [1, 2]
    assert args.read_text().split() == ["-m", "/m.gguf", "-c", "300", "-b", "2048", "-ub", "512", "-npp", "8",
                                        "-ntg", "4", "-npl", "1,2", "-t", "3", "-ngl", "0", "--output-format", "jsonl"]
    assert m.returncode == 0 and m.peak_rss_bytes > 0 and m.wall_seconds > 0 and not m.timed_out
    assert log.entries[0]["command"] == m.shown and log.entries[0]["exit"] == 0


def test_batched_bench_missing_rows_and_failures_are_errors(tmp_path):
    one = tmp_path / "one"
    one.write_text(BB.splitlines()[1] + "\n")
    exe = _tool(tmp_path, "bb", f"cat {one}\n")
    with pytest.raises(DgrError, match=r"no rows for concurrency \[2\]"):
        lt.batched_bench(exe, Path("/m"), threads=1, n_prompt=8, n_gen=4, npl=[1, 2], ctx=64)
    bad = _tool(tmp_path, "bad", 'echo "error: failed to load model" >&2\nexit 3\n')
    with pytest.raises(DgrError, match=r"llama-batched-bench failed \(exit 3\): error: failed to load model"):
        lt.batched_bench(bad, Path("/m"), threads=1, n_prompt=8, n_gen=4, npl=[1], ctx=64)


def test_a_batched_bench_run_that_lost_its_output_is_run_again(tmp_path):
    """The pinned tool's logger may drop every row at exit (it exits 0 having printed nothing):
    such a run is repeated, each attempt logged, and a tool that never prints stops after
    BATCHED_BENCH_ATTEMPTS runs."""
    out, count = tmp_path / "out", tmp_path / "count"
    out.write_text(BB)
    exe = _tool(tmp_path, "flaky", f'echo x >> {count}\nif [ $(wc -l < {count}) -ge 2 ]; then cat {out}; fi\n')
    log = lt.CommandLog()
    rows, _ = lt.batched_bench(exe, Path("/m"), threads=1, n_prompt=8, n_gen=4, npl=[1, 2], ctx=64, log=log)
    assert sorted(rows) == [1, 2] and len(log.entries) == 2
    silent = _tool(tmp_path, "silent", f'echo x >> {tmp_path / "n"}\n')
    with pytest.raises(DgrError, match=r"no rows for concurrency \[1\] \(3 runs"):
        lt.batched_bench(silent, Path("/m"), threads=1, n_prompt=8, n_gen=4, npl=[1], ctx=64)
    assert len((tmp_path / "n").read_text().split()) == lt.BATCHED_BENCH_ATTEMPTS == 3


def test_llama_bench_runs_with_depth_and_a_deadline(tmp_path):
    out = tmp_path / "out"
    out.write_text(LB)
    args = tmp_path / "args"
    exe = _tool(tmp_path, "llama-bench", f'echo "$@" > {args}\ncat {out}\n')
    rows, m = lt.llama_bench(exe, Path("/m.gguf"), threads=2, n_prompt=0, n_gen=4, reps=1, depth=8)
    assert len(rows) == 2 and m.argv[0] == str(exe)
    assert args.read_text().split() == ["-m", "/m.gguf", "-t", "2", "-p", "0", "-n", "4", "-d", "8", "-r", "1",
                                        "-o", "json"]
    slow = _tool(tmp_path, "slow", "exec sleep 30\n")
    with pytest.raises(DgrError, match="took over 0s and was stopped"):
        lt.llama_bench(slow, Path("/m"), threads=1, n_prompt=1, n_gen=1, reps=1, timeout=0.2)


def test_a_missing_executable_is_a_clear_error(tmp_path):
    with pytest.raises(DgrError, match="cannot run"):
        lt.run_measured([tmp_path / "nope"])


def test_recorded_fixtures_are_what_the_tools_print():
    # the llama-bench fixture is one JSON array; the batched-bench one has a log line first
    assert isinstance(json.loads(LB), list)
    assert not BB.splitlines()[0].startswith("{")


@pytest.mark.native
def test_the_pinned_tools_through_the_wrapper(tmp_path):
    """The real llama-bench and llama-batched-bench of this build on a tiny synthetic model,
    through the wrapper: the commands it renders are accepted, the parsers read the rows the
    tools print, and every field the recorded fixtures above carry is in the real output."""
    from dgr.gguf.synth import SynthSpec, synthesize

    model = synthesize(SynthSpec(n_layer=2, seed=3), tmp_path / "m.gguf")
    rows, m = lt.llama_bench(built("llama-bench", "dgr build --tools"), model, threads=1, n_prompt=8, n_gen=4,
                             reps=1, timeout=120)
    assert m.returncode == 0 and m.peak_rss_bytes > 0
    assert [(r.n_prompt, r.n_gen, r.is_prefill, r.is_decode) for r in rows] == [(8, 0, True, False), (0, 4, False, True)]
    assert all(r.avg_ts > 0 for r in rows)
    real = json.loads(m.stdout[m.stdout.index("["):])
    assert set(json.loads(LB)[0]) <= set(real[0]), set(json.loads(LB)[0]) - set(real[0])

    brows, m = lt.batched_bench(built("llama-batched-bench", "dgr build --tools"), model, threads=1, n_prompt=8,
                                n_gen=4, npl=[1, 2], ctx=64, timeout=120)
    assert m.returncode == 0 and sorted(brows) == [1, 2]
    one, two = brows[1], brows[2]
    assert (one.pp, one.tg, one.n_kv, two.n_kv) == (8, 4, 12, 24)
    assert one.speed_tg > 0 and two.speed_pp > 0 and one.t_pp > 0
    fixture_row = json.loads(next(line for line in BB.splitlines() if line.startswith("{")))
    real_row = json.loads(next(line for line in (m.stdout + "\n" + m.stderr).splitlines()
                               if line.startswith("{") and '"speed_tg"' in line))
    assert set(fixture_row) <= set(real_row), set(fixture_row) - set(real_row)
