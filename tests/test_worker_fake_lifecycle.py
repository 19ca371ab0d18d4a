"""dgr-worker in fake-model mode: admission budgets, the queue limit, TTL eviction, the
Prometheus text, and the process lifecycle (SIGTERM drain, SIGKILL, stream deadlines), each on
a worker of its own (DGR-008/012)."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from dgr.shard.v1 import shard_runtime_pb2 as pb
from dgr.protocol.client import ShardError, WorkerError, WorkerUnavailable
from fakeroute import fake_worker_binary, poll, run_alone, start_worker as start

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def worker_bin(native_bin: Path) -> Path:
    return fake_worker_binary(native_bin)


def test_budgets_reject_with_resource_exhausted(worker_bin):
    with start(worker_bin, "--max-sessions", "2", "--kv-cells", "64", "--ctx-per-session", "40") as w:
        c = w.client()
        a, b = c.open_session("a"), c.open_session("b")
        a.prefill([1] * 30)
        b.prefill([2] * 20)
        third = c.open_session("c")
        with pytest.raises(ShardError) as ei:
            third.prefill([3])
        e = ei.value
        assert e.reason == pb.ERROR_REASON_OVER_BUDGET and e.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert e.proto.limit == 2 and "sessions" in str(e)
        # KV budget: 30 + 20 held, 64 total -> 20 more rows do not fit
        with pytest.raises(ShardError) as ei:
            b.prefill_chunk([2] * 20)
        assert ei.value.reason == pb.ERROR_REASON_OVER_BUDGET and ei.value.proto.limit == 64
        # per-session limit
        with pytest.raises(ShardError) as ei:
            a.prefill_chunk([1] * 11)
        assert ei.value.reason == pb.ERROR_REASON_OVER_BUDGET and ei.value.proto.limit == 40
        assert c.metric("dgr_rejected_admissions_total", reason="sessions") >= 1
        assert c.metric("dgr_rejected_admissions_total", reason="kv") >= 2
        # both sessions still work; after a release the third is admitted
        a.decode(1)
        a.release()
        admitted = third.prefill([3])
        b.release()
        third.release()
        for s in (a, b, third):
            s.close()
        assert admitted == run_alone(c, [3], n=0)[0]   # what the deterministic model gives alone


def test_queue_limit_rejects_and_memory_stays_bounded(worker_bin):
    with start(worker_bin, "--queue-limit", "4", "--fake-delay-ms", "20", "--max-sessions", "64") as w:
        c = w.client()
        rss0 = w.rss_bytes()
        rejected = []
        stop = time.monotonic() + 6.0

        def flood(i):
            try:
                s = c.open_session(f"f{i}")
                try:
                    s.prefill([1, 2, 3])
                except ShardError as exc:
                    rejected.append(exc.reason)
                while time.monotonic() < stop:
                    # a frame the worker must read and answer: out-of-vocab prefill of max size
                    req = s._input_frame(pb.PHASE_PREFILL, [999] * 200, None, True)
                    try:
                        s.exchange(req)
                    except ShardError as exc:
                        rejected.append(exc.reason)
                s.close()
            except WorkerError:
                pass

        threads = [threading.Thread(target=flood, args=(i,)) for i in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert pb.ERROR_REASON_OVER_BUDGET in rejected
        assert c.metric("dgr_rejected_admissions_total", reason="queue") >= 1
        rss1 = w.rss_bytes()
        assert rss1 - rss0 < 96 << 20, (rss0, rss1)
        assert poll(lambda: c.load().queued_steps == 0 and c.load().active_sessions == 0, what="queue drained")


def test_ttl_eviction_gives_cache_miss(worker_bin):
    with start(worker_bin, "--session-ttl-s", "0.3") as w:
        c = w.client()
        s = c.open_session("idle")
        first = s.prefill([1, 2])
        poll(lambda: c.metric("dgr_sessions_evicted_total") >= 1, what="eviction")
        with pytest.raises(ShardError) as ei:
            s.decode(first)
        assert ei.value.reason == pb.ERROR_REASON_CACHE_MISS
        assert c.load().kv_cells_used == 0
        s.close()


def test_prometheus_text(worker_bin):
    with start(worker_bin, "--metrics-listen", "127.0.0.1:0") as w:
        c = w.client()
        run_alone(c, [1, 2, 3], n=3)
        assert w.metrics_port
        raw = text = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5).read().decode()
        for name in ("dgr_active_sessions", "dgr_queue_depth", "dgr_kv_cells_used", "dgr_kv_cells_total",
                     "dgr_prefill_tokens_total", "dgr_decode_tokens_total", "dgr_rejected_admissions_total",
                     "dgr_step_latency_seconds_bucket", "dgr_batch_occupancy_sessions_bucket", "dgr_worker_info"):
            assert name in text, name
        # no session ids anywhere: every "session" is part of a metric name or a fixed label value
        allowed = ("dgr_active_sessions", "dgr_max_sessions", "dgr_sessions_", "dgr_batch_occupancy_sessions",
                   'reason="sessions"')
        for a in allowed:
            text = text.replace(a, "")
        assert "session" not in text
        assert "dgr_decode_tokens_total 3" in raw


def test_sigterm_drains_and_exits_zero(worker_bin):
    w = start(worker_bin, "--fake-delay-ms", "5", "--drain-timeout-s", "1.5")
    c = w.client()
    idle = c.open_session("idle")  # released, but its stream stays open: shutdown must end it too
    idle.prefill([4])
    idle.release()
    s = c.open_session("busy")
    tok = s.prefill([1, 2, 3])
    outcome: list[object] = []
    started = threading.Event()

    def gen():
        nonlocal tok
        try:
            while True:
                tok = s.decode(tok)
                started.set()
        except (ShardError, WorkerError) as exc:
            outcome.append(exc)

    t = threading.Thread(target=gen)
    t.start()
    started.wait(10)
    t0 = time.monotonic()
    rc = w.terminate(timeout=15)
    elapsed = time.monotonic() - t0
    t.join(10)
    assert rc == 0
    assert elapsed < 1.5 + 3.0
    assert outcome, "the generating client saw the end"
    exc = outcome[0]
    assert (isinstance(exc, ShardError) and exc.reason == pb.ERROR_REASON_UNAVAILABLE) or \
        (isinstance(exc, WorkerError) and exc.code == grpc.StatusCode.UNAVAILABLE)
    assert any("drained" in line for line in w.stderr_lines)


def test_kill9_gives_unavailable_quickly(worker_bin):
    w = start(worker_bin, "--fake-delay-ms", "3000")
    c = w.client(timeout=30)
    s = c.open_session("doomed", step_timeout=30)
    s.send(s._input_frame(pb.PHASE_PREFILL, [1, 2, 3], None, True))
    poll(lambda: c.load().queued_steps >= 1, what="step queued")
    t0 = time.monotonic()
    w.kill()
    with pytest.raises(WorkerUnavailable):
        s.recv(timeout=20)
    assert time.monotonic() - t0 < 10
    with pytest.raises(WorkerUnavailable):
        c.capability(refresh=True, timeout=5)


def test_stream_deadline_releases_the_session(worker_bin):
    with start(worker_bin, "--fake-delay-ms", "1500") as w:
        c = w.client()
        s = c.open_session("late", stream_deadline=0.5)
        with pytest.raises(WorkerError) as ei:
            s.prefill([1, 2, 3])
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert poll(lambda: c.load().active_sessions == 0 and c.load().kv_cells_used == 0, 10,
                    what="session released after the deadline")
        assert c.metric("dgr_sessions_cancelled_total") >= 1
