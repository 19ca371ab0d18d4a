"""The worker's one option table (`dgr-worker options --json`) against what a worker reports
(GetCapability), what `dgr worker serve` checks, and how Python reads it (dgr.route.worker_options,
dgr.protocol.limits: no restated defaults, a missing limit is an error)."""

from __future__ import annotations

import json
import stat
import subprocess
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer

from dgr.errors import DgrError
from dgr.protocol.limits import REQUIRED_LIMITS, CapabilityError, capacity_limit, check_capacity
from dgr.route import worker_options as wo
from dgr.shard.v1 import shard_runtime_pb2 as pb
from fakeroute import start_fake


def _table(native_bin: Path) -> dict[str, dict]:
    r = subprocess.run([str(native_bin / "dgr-worker"), "options", "--json"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    return {o["name"]: o for o in json.loads(r.stdout)["options"]}


@pytest.mark.native
def test_options_json_agrees_with_the_capability_of_a_worker_started_without_flags(native_bin: Path):
    t = _table(native_bin)
    with start_fake(native_bin) as w:
        cap = w.client().capability()
    c = cap.capacity
    assert c.max_sessions == t["max-sessions"]["default"]
    assert c.max_session_positions == t["ctx-per-session"]["default"]
    assert c.max_batch_tokens == t["max-batch-tokens"]["default"]
    assert c.max_prefill_chunk_tokens == t["max-prefill-chunk"]["default"]
    assert c.max_message_bytes == t["max-message-bytes"]["default"]
    assert cap.identity.n_layer == t["n-layer"]["default"] and cap.identity.n_embd == t["n-embd"]["default"]
    assert cap.identity.n_vocab == t["n-vocab"]["default"]
    check_capacity(cap)   # every limit reported
    # the client's own sizes (before it knows a worker) fit what a default worker takes
    from dgr.protocol.bundle import DEFAULT_FRAGMENT_BYTES
    from dgr.protocol.channel import DEFAULT_MAX_MESSAGE_BYTES
    assert DEFAULT_MAX_MESSAGE_BYTES >= c.max_message_bytes and DEFAULT_FRAGMENT_BYTES <= c.max_fragment_bytes


@pytest.mark.native
def test_a_flag_changes_what_the_capability_reports(native_bin: Path):
    t = _table(native_bin)
    n = t["max-prefill-chunk"]["default"] // 2
    with start_fake(native_bin, "--max-prefill-chunk", str(n)) as w:
        assert w.client().capability().capacity.max_prefill_chunk_tokens == n != t["max-prefill-chunk"]["default"]


@pytest.mark.native
def test_the_table_lists_every_flag_of_the_usage_and_each_row_is_well_formed(native_bin: Path):
    t = _table(native_bin)
    usage = subprocess.run([str(native_bin / "dgr-worker"), "serve", "--help"], capture_output=True, text=True,
                           timeout=30).stdout
    flags = {w.rstrip(",") for w in usage.split() if w.startswith("--")}
    assert {o["flag"] for o in t.values()} <= flags
    for o in t.values():
        assert o["flag"] == "--" + o["name"] and o["help"]
        assert o["kind"] in ("flag", "u32", "u64", "i32", "real", "text", "range")
        if o["kind"] in ("u32", "u64", "i32", "real"):
            assert o["min"] is not None and o["default"] >= o["min"], o
            assert o["max"] is None or o["default"] <= o["max"], o
        if o["default_text"]:
            assert f"default {o['default_text']}" in " ".join(usage.split()), o["name"]


@pytest.mark.native
def test_out_of_bounds_values_are_refused_by_the_worker_with_the_bounds(native_bin: Path):
    t = _table(native_bin)
    hi = t["max-sessions"]["max"]
    r = subprocess.run([str(native_bin / "dgr-worker"), "serve", "--fake-model", "--max-sessions", str(hi + 1)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.strip() == f"dgr-worker: error: --max-sessions wants {t['max-sessions']['min']} .. {hi}, got '{hi + 1}'"
    r = subprocess.run([str(native_bin / "dgr-worker"), "options", "--bogus"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "unknown options argument '--bogus'" in r.stderr


def _base(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return _base(args[0]) if args else annotation


@pytest.mark.native
def test_dgr_worker_serve_checks_the_workers_own_bounds(native_bin: Path):
    """The Typer bounds of `dgr worker serve` (refused before the worker starts) are the table's."""
    from dgr.main import app

    t = _table(native_bin)
    serve = typer.main.get_command(app).commands["worker"].commands["serve"]
    checked = 0
    for p in serve.params:
        flag = p.opts[0]
        if flag.lstrip("-") not in t or _base(p.type_descriptor.annotation) not in (int, float):
            continue
        row = t[flag.lstrip("-")]
        if p.min is not None:
            # the CLI may refuse a 0 that means "the default" (--threads, --kv-cells): leave the option out
            assert p.min == row["min"] or (row["min"] == 0 and p.min == 1), (flag, p.min, row["min"])
        if p.max is not None:
            assert row["max"] is not None and p.max == row["max"], flag
        checked += 1
    assert checked >= 10


@pytest.mark.native
def test_worker_options_reads_the_binary_once(native_bin: Path, monkeypatch):
    binary = native_bin / "dgr-worker"
    table = wo.worker_options(binary)
    assert table["max-sessions"].default == _table(native_bin)["max-sessions"]["default"]
    assert wo.worker_default("ctx-per-session", binary) == table["ctx-per-session"].default

    def no_run(*a, **k):
        raise AssertionError("the table is cached")
    monkeypatch.setattr(wo.subprocess, "run", no_run)
    assert wo.worker_options(binary) is table
    with pytest.raises(DgrError, match="no option --no-such"):
        wo.worker_default("no-such", binary)


def test_worker_options_errors_say_what_went_wrong(tmp_path: Path):
    with pytest.raises(DgrError, match="not built"):
        wo.worker_options(tmp_path / "missing")
    old = tmp_path / "old-worker"
    old.write_text("#!/bin/sh\necho \"dgr-worker: error: unknown argument 'options'\" >&2\nexit 2\n")
    old.chmod(old.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(DgrError, match="options --json failed: dgr-worker: error: unknown argument") as e:
        wo.worker_options(old)
    assert "rebuild" in e.value.hint
    junk = tmp_path / "junk-worker"
    junk.write_text("#!/bin/sh\necho '{\"rows\": []}'\n")
    junk.chmod(junk.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(DgrError, match="printed no option table"):
        wo.worker_options(junk)


def _capability(**capacity: int) -> pb.GetCapabilityResponse:
    full = dict(max_sessions=4, kv_cells=1024, max_session_positions=256, max_batch_tokens=64,
                max_prefill_chunk_tokens=32, max_message_bytes=1 << 20, max_fragment_bytes=1 << 16)
    full.update(capacity)
    return pb.GetCapabilityResponse(capacity=pb.Capacity(**full))


@pytest.mark.parametrize("field", REQUIRED_LIMITS)
def test_a_capability_without_a_limit_is_an_error_not_a_default(field: str):
    cap = _capability(**{field: 0})
    with pytest.raises(CapabilityError, match=f"worker 10.0.0.1:5 reports no capacity.{field} \\(0\\)"):
        check_capacity(cap, endpoint="10.0.0.1:5")
    with pytest.raises(CapabilityError, match=f"capacity.{field}"):
        capacity_limit(cap, field)
    assert capacity_limit(_capability(), field) > 0


def test_the_gateway_refuses_a_worker_without_limits():
    from dgr.serve.engine import Engine

    shard = SimpleNamespace(endpoint="127.0.0.1:9", capability=_capability(max_session_positions=0))
    driver = SimpleNamespace(shards=[shard], head=shard, timeout=1.0)
    with pytest.raises(CapabilityError, match="127.0.0.1:9 reports no capacity.max_session_positions"):
        Engine(typing.cast(typing.Any, driver), model_id="m")


def test_the_route_driver_takes_the_smallest_prefill_chunk_and_refuses_none():
    from dgr.route.driver import RouteDriver

    d = RouteDriver(["a:1", "b:2"])
    d.shards = [SimpleNamespace(endpoint="a:1", capability=_capability(max_prefill_chunk_tokens=32)),
                SimpleNamespace(endpoint="b:2", capability=_capability(max_prefill_chunk_tokens=8))]
    assert d.chunk_tokens == 8
    d.shards[1] = SimpleNamespace(endpoint="b:2", capability=_capability(max_prefill_chunk_tokens=0))
    with pytest.raises(CapabilityError, match="b:2 reports no capacity.max_prefill_chunk_tokens"):
        d.chunk_tokens
