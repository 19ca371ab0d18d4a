"""The demo's whole-model llama.cpp row: llama-batched-bench's JSON lines become the demo's
figures (TTFT, prefill/decode tok/s per session and aggregate, KV bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr.route.llama_whole import batched_bench_command, parse_rows

LINES = """\
main: n_kv_max = 480 (log line, ignored)
{"n_kv_max": 480, "pp": 40, "tg": 16, "pl": 1, "n_kv": 56, "t_pp": 0.5, "speed_pp": 80.0, "t_tg": 0.16, "speed_tg": 100.0, "t": 0.66, "speed": 84.8}
{"n_kv_max": 480, "pp": 40, "tg": 16, "pl": 4, "n_kv": 224, "t_pp": 1.6, "speed_pp": 100.0, "t_tg": 0.4, "speed_tg": 160.0, "t": 2.0, "speed": 112.0}
"""


def test_parse_rows_per_batch_size():
    rows = parse_rows(LINES, kv_bytes_per_cell=1000)
    assert [r.sessions for r in rows] == [1, 4]
    one, four = rows
    assert one.ttft_s == pytest.approx(0.5 + 0.16 / 16)
    assert one.prefill_tok_s == 80.0 and one.decode_tok_s == 100.0 and one.per_session_decode_tok_s == 100.0
    assert four.decode_tok_s == 160.0 and four.per_session_decode_tok_s == 40.0
    assert four.kv_bytes == 224 * 1000
    assert parse_rows("no json here\n", 1) == []


def test_command_fits_every_session_in_the_context():
    cmd = batched_bench_command(Path("/b/llama-batched-bench"), Path("/m.gguf"), threads=2, n_prompt=40, n_gen=16,
                                sessions=(1, 4))
    assert cmd[cmd.index("-c") + 1] == str(4 * (40 + 16) + 256)
    assert cmd[cmd.index("-npl") + 1] == "1,4"
    assert cmd[cmd.index("-t") + 1] == "2"
    assert cmd[-2:] == ["--output-format", "jsonl"]


def _stand_in(tmp_path: Path, body: str) -> Path:
    exe = tmp_path / "llama-batched-bench"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    return exe


def test_measure_runs_the_tool_and_reads_its_rows(tmp_path, monkeypatch):
    from dgr.route import local
    from dgr.route.llama_whole import measure_whole_llama

    args = tmp_path / "args"
    lines = tmp_path / "out.jsonl"
    lines.write_text(LINES)
    exe = _stand_in(tmp_path, f'echo "$@" > {args}\necho "log line" >&2\ncat {lines}\n')
    monkeypatch.setattr("dgr.upstream.build.tool_binary", lambda name, backend="cpu": exe)
    monkeypatch.setattr(local, "model_n_layer", lambda m: 30)
    monkeypatch.setattr(local, "kv_bytes_per_cell", lambda m, a, b: 1000 if (a, b) == (0, 30) else 0)
    got = measure_whole_llama(Path("/m.gguf"), threads=3, n_prompt=40, n_gen=16, sessions=(4, 1, 4))
    assert args.read_text().split() == got.command[1:]
    assert got.command[got.command.index("-t") + 1] == "3" and got.command[got.command.index("-npl") + 1] == "1,4"
    assert [r.sessions for r in got.rows] == [1, 4] and got.rows[1].kv_bytes == 224 * 1000
    assert got.peak_rss_bytes > 0 and got.wall_s > 0
    assert got.to_json()["tool"] == "llama-batched-bench"


def test_measure_fails_with_the_tools_exit_and_stderr(tmp_path, monkeypatch):
    from dgr.errors import DgrError
    from dgr.route.llama_whole import measure_whole_llama

    exe = _stand_in(tmp_path, 'echo "error: failed to load model" >&2\nexit 3\n')
    monkeypatch.setattr("dgr.upstream.build.tool_binary", lambda name, backend="cpu": exe)
    with pytest.raises(DgrError, match=r"exit 3\): error: failed to load model"):
        measure_whole_llama(Path("/m.gguf"), threads=1, n_prompt=8, n_gen=4)
