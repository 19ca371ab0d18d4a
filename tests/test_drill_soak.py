"""`dgr drill --soak`: the chaos soak through the gateway, on fake-model workers (seconds).

A short soak (random kill, stop, term, blackhole and restart under 8 streaming requests) must
hold every invariant; a soak whose reference is deliberately wrong must report it (the checker
can fail); bad options are refused in one line before anything starts; the fault chooser never
takes the last usable worker of a range; a failover race the soak found stays fixed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from dgr.lab.drill import DrillWorker
from dgr.lab.soak import KINDS, SCHEMA, Soak, SoakConfig, SoakWorker, run_soak


def _dgr(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgr.main", "drill", *args], capture_output=True, text=True,
                          timeout=timeout)


# ---- the soak ------------------------------------------------------------------------------------

@pytest.mark.native
def test_a_short_synthetic_soak_holds_every_invariant(native_bin, tmp_path, monkeypatch):
    """15 s, an action every ~1 s, through the CLI, text prompts (tokenized by the gateway)."""
    monkeypatch.setenv("DGR_WORKER_BIN", str(native_bin / "dgr-worker"))
    out = tmp_path / "soak.json"
    r = _dgr("--soak", "0.25", "--fault-every-s", "1", "--synthetic", "--seed", "3", "--json",
             "--out", str(out), timeout=240)
    said = [ln for ln in r.stderr.splitlines() if ln.startswith(("violation", "dgr: error", "Traceback"))]
    assert r.returncode in (0, 1) and r.stdout.startswith("{"), said or r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["schema"] == SCHEMA and doc["mode"] == "synthetic" and doc["placement"] == "local"
    assert r.returncode == 0 and doc["violations"] == [] and doc["violations_total"] == 0, doc["violations"]
    c = doc["config"]
    assert c["minutes"] == 0.25 and c["fault_every_s"] == 1.0 and c["seed"] == 3 and c["concurrency"] == 8
    assert c["prompts"] == "text" and c["max_tokens"] == 64 and c["split"] == ["0:4", "4:8"]
    assert set(doc["commit"]) >= {"sha", "clean"} and len(doc["commit"]["sha"]) == 40
    assert len(doc["load_average"]["start"]) == 3
    f = doc["faults"]
    assert f["injected"] >= 8 and f["disruptive"] >= 4, f
    assert set(f["by_kind"]) == set(KINDS) and sum(f["by_kind"].values()) == f["injected"]
    assert f["on_route"] >= 1
    for e in f["events"]:
        assert {"t_s", "kind", "target", "range", "pid"} <= set(e), e
    assert f["injected"] == len(f["events"])
    rq = doc["requests"]
    assert rq["ok"] > 0 and rq["failed"] == 0 and rq["failures"] == {} and rq["ok"] == rq["started"]
    nd = doc["next_delta_after_fault_s"]
    assert nd["n"] > 0 and 0 <= nd["p50"] <= nd["p99"] <= nd["max"] < 10, nd
    assert doc["gateway"]["in_flight_at_end"] == 0
    assert doc["workers"]["survivors"] and all(s["idle"] for s in doc["workers"]["survivors"])
    assert all(s["idle"] for s in doc["workers"]["retired"])
    assert doc["leaked_processes"] == []
    assert 15 <= doc["soak_s"] < 20 and doc["soak_s"] <= doc["duration_s"] < 15 * 60 + 180


@pytest.mark.native
def test_a_wrong_reference_is_reported_as_a_violation(native_bin, monkeypatch):
    """The checker can fail: one prompt's reference loses its last delta (a test hook), so every
    answer to that prompt differs from it and the soak reports each one."""
    monkeypatch.setenv("DGR_WORKER_BIN", str(native_bin / "dgr-worker"))

    def tamper(refs):
        refs[0].deltas = refs[0].deltas[:-1]

    doc = run_soak(SoakConfig(minutes=0.1, fault_every_s=1.0, seed=5, prompt_ids=True, reference_hook=tamper))
    assert doc["violations_total"] >= 1 and doc["violations"]
    assert all("(prompt 0)" in v and "differs from the reference: 0 deltas lost, 1 repeated" in v
               for v in doc["violations"]), doc["violations"][:3]
    assert doc["requests"]["failures"]["incomplete or wrong answer"]["count"] == doc["violations_total"]
    assert doc["requests"]["ok"] > 0 and doc["leaked_processes"] == []


@pytest.mark.native
def test_a_standby_that_ends_before_the_connect_is_skipped(native_bin):
    """A standby that ends between the route finder's probe and the new route's connect is
    excluded and the next one taken; the session completes (found by the soak)."""
    import asyncio

    from dgr.route.failover import FailoverRouter, PoolRouteFinder
    from fakeroute import start_fake

    head, tail, s1, s2 = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "3")
                          for r in ("0:4", "4:8", "4:8", "4:8")]

    class RacyFinder(PoolRouteFinder):
        raced = False

        async def find(self, exclude, prefer):
            eps = await super().find(exclude, prefer)
            if not self.raced:      # the tail it picked ends right after its probe
                self.raced = True
                next(w for w in (s1, s2) if w.target == eps[-1]).kill()
            return eps

    async def main():
        fr = await FailoverRouter([head.target, tail.target], max_restarts=3).connect()
        ident = fr.route.head.capability.identity
        fr.finder = RacyFinder([w.target for w in (head, tail, s1, s2)],
                               fingerprint=ident.compatibility_fingerprint, artifact_id=ident.artifact_id)
        n = [0]

        def on_token(_t):
            n[0] += 1
            if n[0] == 20:
                tail.kill()
        try:
            return await fr.generate([256, 1, 2, 3], max_tokens=120, stop_on_eog=False, on_token=on_token)
        finally:
            await fr.close()

    try:
        res = asyncio.run(main())
        assert res.error is None and res.record.status == "completed" and len(res.tokens) == 120, res.error
    finally:
        for w in (head, tail, s1, s2):
            w.kill()


# ---- the chooser ---------------------------------------------------------------------------------

def _stub_worker(i: int, rng: tuple[int, int]) -> SoakWorker:
    proc = SimpleNamespace(proc=SimpleNamespace(poll=lambda: None, pid=1000 + i), pid=1000 + i)
    return SoakWorker(i, DrillWorker("spare", rng, proc, f"t{i}", f"127.0.0.1:{20000 + i}"))


def test_the_chooser_never_faults_the_last_usable_worker_of_a_range():
    s = Soak(SoakConfig(minutes=1, seed=11))
    s.links = SimpleNamespace(links={})                     # no link proxies: blackhole has no target
    s.workers = [_stub_worker(i, r) for i, r in enumerate([(0, 4), (4, 8), (0, 4), (4, 8)], 1)]
    seen = set()
    for _ in range(300):
        pick = s.choose()
        assert pick is not None
        kind, target = pick
        seen.add(kind)
        if kind == "restart":
            s.workers.append(_stub_worker(len(s.workers) + 1, target))
            continue
        assert kind != "blackhole"
        assert len(s.usable(target.range, set())) >= 2     # another usable worker is left
        target.state = {"kill": "ended", "term": "ended", "stop": "stopped"}[kind]
    assert seen == {"kill", "stop", "term", "restart"}
    for r in ((0, 4), (4, 8)):
        assert s.usable(r, set())                           # never a range without one


# ---- the command line ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, message, code", [
    (["--soak", "-1"], "Invalid value for '--soak'", 2),
    (["--soak", "121"], "Invalid value for '--soak'", 2),
    (["--soak", "0"], "--soak takes minutes in (0, 120]", 1),
    (["--soak", "1", "--fault", "kill"], "not both", 1),
    ([], "give --fault KIND", 1),
    (["--soak", "1", "--target", "head"], "--target is for the one-fault drill", 1),
    (["--soak", "1", "--fault-every-s", "0.1"], "Invalid value for '--fault-every-s'", 2),
    (["--soak", "1", "--kinds", "kill,explode"], "unknown explode", 1),
    (["--soak", "1", "--kinds", "restart"], "needs at least one of kill", 1),
    (["--soak", "1", "--fake-delay-ms", "0"], "--fake-delay-ms >= 1", 1),
    (["--soak", "1", "--workers-per-range", "1"], "Invalid value for '--workers-per-range'", 2),
    (["--soak", "1", "--out", "/nonexistent-dir/soak.json"], "does not exist", 1),
    (["--fault", "kill", "--seed", "3"], "--seed goes with --soak MINUTES", 1),
])
def test_the_cli_refuses_bad_soak_options_in_one_line(args, message, code):
    r = _dgr(*args)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("dgr: error:") and "Traceback" not in r.stderr + r.stdout


def test_the_cli_help_names_the_soak_options():
    r = _dgr("--help")
    assert r.returncode == 0
    for opt in ("--soak", "--fault-every-s", "--seed", "--kinds", "--workers-per-range", "--prompt-ids"):
        assert opt in r.stdout, opt
