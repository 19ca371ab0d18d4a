"""Failover and the fault drill on fake-model workers (synthetic mode, seconds, no GGUF).

Every fault kind of `dgr drill` runs once: the process faults (kill -9, SIGSTOP, SIGTERM) and
the link faults through the userspace link proxy on loopback (blackhole, latency spike, packet
loss). A failed shard must be detected with an error naming it, every session must end with the
uninterrupted run's answer (no token lost or duplicated), and no surviving worker may keep a
session, a KV cell or a queued step. Timings are reported by the drill, not asserted here.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from dgr.errors import DgrError
from dgr.lab.drill import DrillConfig, compare, run_drill
from dgr.route.failover import Candidate, FailoverRouter, NoRouteError, PoolRouteFinder, classify
from dgr.route.driver import RouteSessionError, ShardHandle
from fakeroute import start_fake

FP, ART = "f" * 64, "a" * 64


# ---- the drill, one test per fault kind ---------------------------------------------------------

@pytest.mark.native
@pytest.mark.parametrize("fault,target", [("kill", "tail"), ("kill", "head"), ("stop", "tail"), ("stop", "head"),
                                          ("term", "tail"), ("blackhole", "tail"), ("latency", "tail"),
                                          ("loss", "tail")])
def test_drill_fault_kinds_recover_without_lost_or_duplicated_tokens(native_bin, fault, target):
    doc = run_drill(DrillConfig(fault=fault, target=target, sessions=4, max_tokens=120, after_tokens=6,
                                latency_ms=200.0, loss=0.3, hold_s=1.0, timeout_s=120))
    s = doc["summary"]
    victim = doc["fault"]["target"].split("@")[1]
    assert s["sessions_completed"] == 4 and s["sessions_failed"] == 0, s
    assert s["answers_equal_reference"] == 4
    assert s["tokens_lost"] == s["tokens_duplicated"] == s["tokens_mismatched"] == 0
    assert s["survivors_holding"] == [], doc["survivors"]
    for w in doc["survivors"]:
        assert w["state"] == "ended" or (w["sessions"], w["kv_cells_used"], w["queued_steps"]) == (0, 0, 0), w
    if fault in ("latency", "loss"):
        # a slower link below the keepalive timeout is no failure: nobody moves
        assert s["sessions_failed_over"] == 0 and len(s["routes"]) == 1
        assert doc["links"][victim]["chunks"] > 0
        if fault == "loss":
            assert doc["links"][victim]["lost_chunks"] > 0
        return
    assert s["sessions_recovered"] == 4 and s["time_to_detect_s"] is not None
    assert len(s["routes"]) == 2 and victim not in s["routes"][1]
    for sess in doc["sessions"]:
        first = sess["record"]["attempts"][0]
        assert first["status"] == "restarted" and first["failed_shard"] == victim, first
        assert victim in first["error"]     # the structured error names the failed shard
        shard_status = {w["shard"].split("[")[0]: w["status"] for w in first["shards"]}
        assert shard_status[victim] == ("unverified" if fault in ("stop", "blackhole") else "failed")
        again = sess["record"]["attempts"][1]
        assert again["status"] == "completed" and again["recomputed_tokens"] == first["delivered_tokens"]
        assert first["delivered_tokens"] + again["delivered_tokens"] == sess["delivered"]
    w = doc["work"]
    assert w["sessions"]["completed"] == 4 and w["restarts"] == 4
    assert w["delivered_tokens"] == 4 * 120


# ---- failover without a standby, bounded restarts ------------------------------------------------

async def _kill_after_first_token(fr: FailoverRouter, worker):
    """A long generation over `fr`; `worker` is killed once the first token arrived (bounded waits)."""
    got = asyncio.Event()
    t = asyncio.create_task(fr.generate([256, 1, 2], max_tokens=2000, stop_on_eog=False,
                                        on_token=lambda _t: got.set()))
    await asyncio.wait_for(got.wait(), 10)
    worker.proc.kill()
    return await asyncio.wait_for(t, 30)


@pytest.mark.native
def test_no_standby_fails_with_the_reason_and_bounded_restarts(native_bin):
    ws = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "3") for r in ("0:4", "4:8")]
    try:
        async def main():
            fr = await FailoverRouter([w.target for w in ws], max_restarts=2).connect()
            try:
                return await _kill_after_first_token(fr, ws[1])
            finally:
                await fr.close()
        r = asyncio.run(main())
        assert isinstance(r.error, NoRouteError) and r.error.kind == "no_standby", r.error
        assert "[4:8)" in str(r.error)
        assert r.record.status == "failed" and r.record.attempts[0].status == "failed"
        assert 0 < len(r.tokens) < 2000
    finally:
        for w in ws:
            w.kill()


@pytest.mark.native
def test_restarts_are_bounded(native_bin):
    """max_restarts=0: the first failure ends the session (no new route is tried)."""
    ws = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "3") for r in ("0:4", "4:8", "4:8")]
    try:
        async def main():
            fr = await FailoverRouter([w.target for w in ws[:2]], max_restarts=0).connect()
            fr.finder.endpoints.append(ws[2].target)
            try:
                return await _kill_after_first_token(fr, ws[1]), fr.routes
            finally:
                await fr.close()
        r, routes = asyncio.run(main())
        assert r.error is not None and "gave up after 0 restart" in str(r.error)
        assert r.record.restarts == 0 and len(routes) == 1
    finally:
        for w in ws:
            w.kill()


@pytest.mark.native
def test_seeded_sampling_keeps_the_delivered_prefix(native_bin):
    """Seeded sampling over a failover: every delivered token once, the budget met; the tokens
    after the restart are drawn afresh from the seed (documented, not those of an uninterrupted run)."""
    from dgr.route.driver import Sampling

    ws = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "3") for r in ("0:4", "4:8", "4:8")]
    try:
        async def main():
            fr = await FailoverRouter([w.target for w in ws[:2]]).connect()
            fr.finder.endpoints.append(ws[2].target)
            seen: list[int] = []
            try:
                got = asyncio.Event()

                def on(t):
                    seen.append(t)
                    if len(seen) >= 10:
                        got.set()
                t = asyncio.create_task(fr.generate([256, 1, 2], max_tokens=200, stop_on_eog=False, on_token=on,
                                                    sampling=Sampling(temperature=0.8, seed=7)))
                await asyncio.wait_for(got.wait(), 10)
                ws[1].proc.kill()
                return await asyncio.wait_for(t, 30), seen
            finally:
                await fr.close()
        r, seen = asyncio.run(main())
        assert r.error is None and r.record.restarts == 1
        assert r.tokens == seen and len(seen) == 200
        a0, a1 = r.record.attempts
        assert a1.recomputed_tokens == a0.delivered_tokens and a0.delivered_tokens + a1.delivered_tokens == 200
    finally:
        for w in ws:
            w.kill()


# ---- route formation and classification (no workers) --------------------------------------------

def _finder(cands: dict[str, Candidate | str]) -> PoolRouteFinder:
    f = PoolRouteFinder(list(cands), fingerprint=FP, artifact_id=ART)

    async def probe(ep):
        return cands[ep]
    f._probe = probe
    return f


def _c(ep, a, b, fp=FP, free=4):
    return Candidate(ep, a, b, 8, fp, ART, free)


def test_pool_finder_prefers_the_current_route_and_avoids_failed():
    f = _finder({"h": _c("h", 0, 4), "t": _c("t", 4, 8), "h2": _c("h2", 0, 4), "t2": _c("t2", 4, 8)})
    assert asyncio.run(f.find({"t"}, ["h", "t"])) == ["h", "t2"]
    assert asyncio.run(f.find({"h"}, ["h", "t"])) == ["h2", "t"]
    assert asyncio.run(f.find(set(), ["h2", "t"])) == ["h2", "t"]


@pytest.mark.parametrize("cands,kind,needle", [
    ({"h": _c("h", 0, 4), "t": _c("t", 4, 8)}, "no_standby", "[4:8)"),
    ({"h": _c("h", 0, 4), "t": _c("t", 4, 8), "x": _c("x", 4, 8, fp="e" * 64)}, "recipe_mismatch", "eeeeeeeeeeee"),
    ({"h": _c("h", 0, 4), "t": _c("t", 4, 8), "full": _c("full", 4, 8, free=0)}, "capacity", "full[4:8)"),
    ({"t": _c("t", 4, 8), "gone": "gone: unreachable (UNAVAILABLE)"}, "unreachable", "gone"),
])
def test_no_route_says_why(cands, kind, needle):
    with pytest.raises(NoRouteError) as ei:
        asyncio.run(_finder(cands).find({"t"}, ["h", "t"]))
    assert ei.value.kind == kind and needle in str(ei.value), str(ei.value)


def test_classify_failures():
    sh = ShardHandle.__new__(ShardHandle)
    sh.endpoint = "e"
    sh.capability = type("C", (), {"identity": type("I", (), {"range": type("R", (), {"start": 0, "end": 4})()})()})()
    mk = lambda r: RouteSessionError(sh, r, "x")   # noqa: E731
    assert classify(mk("UNAVAILABLE")) == classify(mk("ERROR_REASON_UNAVAILABLE")) == "shard_lost"
    assert classify(mk("DEADLINE_EXCEEDED")) == classify(mk("STREAM_CLOSED")) == "shard_lost"
    assert classify(mk("ERROR_REASON_CACHE_MISS")) == classify(mk("ERROR_REASON_STALE_EPOCH")) == "state_lost"
    assert classify(mk("ERROR_REASON_BAD_REQUEST")) == classify(mk("ERROR_REASON_TOKEN_OUT_OF_VOCAB")) == "fatal"


def test_compare_counts_lost_duplicated_mismatched():
    assert compare([1, 2, 3, 4], [1, 2, 3, 4]) == (0, 0, 0)
    assert compare([1, 2, 3, 4], [1, 2, 2, 3, 4]) == (0, 1, 0)
    assert compare([1, 2, 3, 4], [1, 2, 3]) == (1, 0, 0)
    assert compare([1, 2, 3, 4], [1, 9, 3, 4]) == (0, 0, 1)


def test_drill_config_rejects_bad_input():
    with pytest.raises(DgrError, match="unknown fault"):
        DrillConfig(fault="explode").validate()
    with pytest.raises(DgrError, match="--target"):
        DrillConfig(fault="kill", target="5").validate()
    with pytest.raises(DgrError, match="--sessions"):
        DrillConfig(fault="kill", sessions=0).validate()


def test_drill_cli_help_and_one_line_errors():
    run = lambda *a: subprocess.run([sys.executable, "-m", "dgr.main", "drill", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=60)
    h = run("--help")
    assert h.returncode == 0 and "--fault" in h.stdout and "blackhole" in h.stdout
    for args, msg in ((["--fault", "explode"], "unknown fault"), (["--fault", "kill", "--target", "middle"], "--target"),
                      (["--fault", "kill", "--model", "/nonexistent.gguf"], "model file not found")):
        r = run(*args)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().startswith("dgr: error:") and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.native
def test_route_sessions_with_standby_report_work_records(native_bin):
    """run_sessions (dgr route generate --standby): a killed tail moves the sessions to the standby;
    the report carries the routes used and the work records (telemetry and summary)."""
    from dgr.route.sessions import run_sessions

    ws = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "3") for r in ("0:4", "4:8", "4:8")]
    try:
        prompts = [[256, 7, 8, 9], [256, 1]]

        async def main():
            ref = await run_sessions([w.target for w in ws[:2]], ["a", "b"], token_prompts=prompts, max_tokens=300,
                                     stop_on_eog=False)
            killed = []

            def on_text(_i, _t):
                if not killed:
                    killed.append(ws[1].proc.kill())
            rep = await run_sessions([w.target for w in ws[:2]], ["a", "b"], token_prompts=prompts, max_tokens=300,
                                     stop_on_eog=False, standby=[ws[2].target], on_text=on_text, stream_period=0.05)
            return ref, rep, killed
        ref, rep, killed = asyncio.run(main())
        assert killed and rep.ok, [s.error for s in rep.sessions]
        assert [s.tokens for s in rep.sessions] == [s.tokens for s in ref.sessions]
        assert rep.routes[-1] == [ws[0].target, ws[2].target]
        assert rep.work["restarts"] == 2 and rep.work["delivered_tokens"] == 600
        doc = rep.to_json()
        assert doc["work"]["sessions"]["completed"] == 2
        for s in doc["sessions"]:
            w = s["telemetry"]["work"]
            assert w["status"] == "completed" and [a["status"] for a in w["attempts"]] == ["restarted", "completed"]
    finally:
        for w in ws:
            w.kill()


def test_link_proxy_control_file_reshapes_the_link(tmp_path):
    """The lab proxy's --control file (re-read on SIGHUP): latency and loss at run time; a bad
    file changes nothing."""
    from dgr.lab.proxy import Link, LinkSpec, reshape

    link = Link(LinkSpec(delay_ms=0.1))
    ctl = tmp_path / "c.json"
    ctl.write_text(json.dumps({"delay_ms": 300, "loss": 0.3}))
    reshape(link, ctl)
    assert (link.spec.delay_ms, link.spec.loss, link.spec.jitter_ms) == (300.0, 0.3, 0.0)
    ctl.write_text(json.dumps({"loss": 2}))
    reshape(link, ctl)
    assert link.spec.loss == 0.3
    ctl.write_text("{not json")
    reshape(link, ctl)
    assert link.spec.delay_ms == 300.0


@pytest.mark.native
def test_cancel_through_the_failover_router_is_not_restarted(native_bin):
    """A cancelled session ends cancelled on every shard and is never restarted elsewhere."""
    ws = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "3") for r in ("0:4", "4:8", "4:8")]
    try:
        async def main():
            fr = await FailoverRouter([w.target for w in ws[:2]]).connect()
            fr.finder.endpoints.append(ws[2].target)
            try:
                got = asyncio.Event()
                t = asyncio.create_task(fr.generate([256, 1, 2], max_tokens=2000, stop_on_eog=False,
                                                    session_id="c1", on_token=lambda _t: got.set()))
                await asyncio.wait_for(got.wait(), 10)
                held = await fr.cancel("c1")
                return held, await asyncio.wait_for(t, 30), fr.routes
            finally:
                await fr.close()
        held, r, routes = asyncio.run(main())
        assert any(held)
        assert r.record.status == "cancelled" and r.record.restarts == 0 and len(routes) == 1
        assert [w.status for w in r.record.attempts[0].shards] == ["cancelled", "cancelled"]
        assert 0 < len(r.tokens) < 2000
        for w in ws:
            with w.client() as c:
                end = time.monotonic() + 10
                while (ld := c.load()).active_sessions or ld.kv_cells_used:
                    assert time.monotonic() < end, ld
    finally:
        for w in ws:
            w.kill()


@pytest.mark.native
@pytest.mark.lab
def test_drill_on_lab_hosts_recovers(native_bin, monkeypatch):
    """The drill's --lab mode: primary and standby workers on two simulated hosts (mTLS), the
    tail killed, every session restarted on the standby with nothing lost."""
    from dgr.lab import system as sx
    from dgr.lab.hosts import Lab, LabConfig

    reason = sx.preflight()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("DGR_WORKER_BIN", str(native_bin / "dgr-worker"))
    with Lab.up(LabConfig(hosts=2, name="dr1")):
        doc = run_drill(DrillConfig(fault="kill", target="tail", sessions=2, max_tokens=60, after_tokens=6,
                                    lab="dr1", timeout_s=120))
    s = doc["summary"]
    assert s["sessions_recovered"] == 2 and s["sessions_failed"] == 0, s
    assert s["tokens_lost"] == s["tokens_duplicated"] == s["tokens_mismatched"] == 0
    assert s["survivors_holding"] == []
    assert all(ep.split(":")[0].startswith("198.1") for route in s["routes"] for ep in route)
