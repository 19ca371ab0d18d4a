"""GgufShardBackend: the node-service surface over supervised fake-model workers."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dgr.gguf.recipe import Registry
from meshnet_adapter.backend import BackendConfig, BackendError, GgufShardBackend, RestartPolicy
from dgr.protocol.client import Sampling
from meshnet_adapter.routing import NoRoute, form_routes
from dgr.route.supervisor import WorkerProcess

pytestmark = pytest.mark.native


def _cfg(native_bin, start, end, tmp_path=None, **kw) -> BackendConfig:
    return BackendConfig(model=None, start=start, end=end, fake=True, binary=native_bin / "dgr-worker",
                         log_path=(tmp_path / f"w{start}-{end}.log") if tmp_path else None,
                         health_period_s=0.2, **kw)


def _wait(pred, timeout=20.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.05)


def test_two_backends_run_a_route_step_by_step_and_attribute_work(native_bin, tmp_path):
    empty = Registry(entries=())
    with GgufShardBackend(_cfg(native_bin, 0, 4, tmp_path)) as head, \
            GgufShardBackend(_cfg(native_bin, 4, 8, tmp_path)) as tail:
        rh = head.load(node_id="node-a", registry=empty)
        rt = tail.load(node_id="node-b", registry=empty)
        assert (rh.start, rh.end, rt.start, rt.end) == (0, 4, 4, 8)
        assert rh.fingerprint == rt.fingerprint and rh.artifact_id == rt.artifact_id
        assert rh.capacity.max_sessions == 16 and rh.capacity.kv_cells_total > 0
        assert not rh.certified  # the fake recipe is not in the registry: dark
        assert isinstance(form_routes([rh, rt], rh.artifact_id), NoRoute)

        prompt = [256, *b"backend"]
        hs = head.open_session("s1", request_id="req-1")
        ts = tail.open_session("s1", request_id="req-1", sampling=Sampling(ignore_eog=True))
        out = hs.step(tokens=prompt)
        assert out.boundary is not None and out.boundary.shape == (len(prompt), 8)
        tok = ts.step(rows=out.boundary).token
        got = [tok]
        for _ in range(9):
            b = hs.step(tokens=[got[-1]], decode=True).boundary
            got.append(ts.step(rows=b, decode=True).token)
        hs.release()
        ts.release()
        # the same tokens as one whole fake worker
        with WorkerProcess.start(["--fake-model"], binary=native_bin / "dgr-worker") as w, w.client() as c:
            s = c.open_session("w", sampling=Sampling(ignore_eog=True))
            first = s.prefill(prompt)
            assert [first, *s.generate(first, 9)] == got
        tel = head.telemetry()
        rec = next(r for r in tel["sessions"] if r["session_id"] == "s1")
        assert rec["request_id"] == "req-1" and rec["status"] == "completed"
        assert rec["prefill_tokens"] == len(prompt) and rec["decode_tokens"] == 9
        _wait(lambda: head.telemetry()["load"]["active_sessions"] == 0)
    log = (tmp_path / "w0-4.log").read_text()
    assert "worker started" in log and "dgr-worker: serving" in log


def test_cancel_session_is_attributed_as_cancelled(native_bin):
    with GgufShardBackend(_cfg(native_bin, 0, 8)) as b:
        b.load(node_id="n", registry=Registry(entries=()))
        s = b.open_session("c1", request_id="req-c")
        s.step(tokens=[256, 1, 2, 3])
        assert b.cancel_session("c1")
        with pytest.raises(BackendError):
            s.step(tokens=[5], decode=True)
        rec = b.telemetry()["sessions"][0]
        assert rec["status"] == "cancelled"


def test_supervisor_restarts_a_dead_worker_and_fails_its_sessions(native_bin, tmp_path):
    pol = RestartPolicy(max_restarts=1, window_s=60, backoff_s=0.1)
    with GgufShardBackend(_cfg(native_bin, 0, 8, tmp_path, restart=pol)) as b:
        b.load(node_id="n", registry=Registry(entries=()))
        s = b.open_session("k1", request_id="req-k")
        before = s.step(tokens=[256, 7]).token
        pid0 = b.pid
        b._proc.proc.kill()
        _wait(lambda: b.pid != pid0 and b.health() == "SERVING")
        assert b.restarts == 1
        with pytest.raises(BackendError) as ei:
            s.step(tokens=[3], decode=True)
        assert ei.value.terminated
        assert b.telemetry()["sessions"][0]["status"] == "failed"
        # a new session works on the restarted worker
        s2 = b.open_session("k2")
        assert s2.step(tokens=[256, 7]).token == before   # the same deterministic model
        s2.release()
        # second death: the policy (1 restart per window) is exhausted -> FAILED, no more restarts
        b._proc.proc.kill()
        _wait(lambda: b.health() == "FAILED")
        with pytest.raises(BackendError, match="restart policy exhausted"):
            b.open_session("k3")
    log = (tmp_path / "w0-8.log").read_text()
    assert "worker down" in log and "restart policy exhausted" in log
