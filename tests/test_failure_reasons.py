"""Typed failure reasons, end to end: one ``Reason`` vocabulary in Python for every protocol
reason and gRPC status, and a chained head that names the Shard that failed in ShardError's
``failed_endpoint``/``failed_start``/``failed_end`` (the driver reads those fields, never the
message text)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import grpc
import pytest

from dgr.protocol.client import ShardError, WorkerClient
from dgr.protocol.errors import Reason
from dgr.route.driver import RouteDriver
from dgr.route.failover import classify
from dgr.route.shards import RouteSessionError, as_reason, route_error
from dgr.shard.v1 import shard_runtime_pb2 as pb
from fakeroute import start_fake


def test_every_protocol_reason_and_grpc_status_has_a_member():
    for name, value in pb.ErrorReason.items():
        r = Reason.of_error_reason(value)
        assert r == (Reason.UNKNOWN if value == pb.ERROR_REASON_UNSPECIFIED else name.removeprefix("ERROR_REASON_"))
    assert Reason.of_error_reason(10_000) is Reason.UNKNOWN     # a newer worker's reason
    for code in grpc.StatusCode:
        assert Reason.of_status(code) == code.name


def test_keepalive_is_read_from_grpc_text_once_and_is_silent():
    assert Reason.of_status(grpc.StatusCode.UNAVAILABLE, "keepalive watchdog timeout") is Reason.KEEPALIVE
    assert Reason.of_status(grpc.StatusCode.UNAVAILABLE, "ping timeout") is Reason.KEEPALIVE
    assert Reason.of_status(grpc.StatusCode.UNAVAILABLE, "Socket closed") is Reason.UNAVAILABLE
    assert {r for r in Reason if r.silent} == {Reason.DEADLINE_EXCEEDED, Reason.KEEPALIVE, Reason.PEER_SILENT}
    # a worker's message that merely mentions a keepalive is not a silent failure
    err = pb.ShardError(reason=pb.ERROR_REASON_UNAVAILABLE, message="draining; keepalive ok")
    assert not ShardError(err).kind.silent


def _shard(endpoint: str, start: int, end: int):
    rng = SimpleNamespace(start=start, end=end)
    return SimpleNamespace(endpoint=endpoint, start=start, end=end,
                           capability=SimpleNamespace(identity=SimpleNamespace(range=rng)))


def test_route_error_carries_the_named_shard_and_the_driver_uses_only_the_fields():
    head, mid, tail = _shard("127.0.0.1:7001", 0, 3), _shard("127.0.0.1:700", 3, 5), _shard("127.0.0.1:7002", 5, 8)
    err = pb.ShardError(reason=pb.ERROR_REASON_PEER_SILENT, grpc_code=14,
                        message="downstream 127.0.0.1:700 [3, 5): anything at all",
                        failed_endpoint="127.0.0.1:7002", failed_start=5, failed_end=8)
    exc = route_error(head, ShardError(err))
    assert exc.reason is Reason.PEER_SILENT and exc.reason.silent and classify(exc) == "shard_lost"
    assert (exc.failed_endpoint, exc.failed_range) == ("127.0.0.1:7002", (5, 8))
    drv = SimpleNamespace(shards=[head, mid, tail])
    # the message names the middle shard; the field names the tail: the field wins
    assert RouteDriver._named_shard(drv, exc) is tail
    # an endpoint on the route with another range is not that shard
    other = route_error(head, ShardError(pb.ShardError(reason=pb.ERROR_REASON_UNAVAILABLE,
                                                       failed_endpoint="127.0.0.1:7002", failed_start=4,
                                                       failed_end=8)))
    assert RouteDriver._named_shard(drv, other) is None
    # no field: no shard named, whatever the message says
    plain = route_error(head, ShardError(pb.ShardError(reason=pb.ERROR_REASON_UNAVAILABLE,
                                                       message="downstream 127.0.0.1:7002 [5, 8): gone")))
    assert plain.failed_endpoint is None and RouteDriver._named_shard(drv, plain) is None


def test_reason_names_convert_and_unknown_names_are_refused():
    assert as_reason("ERROR_REASON_CACHE_MISS") is Reason.CACHE_MISS
    assert as_reason("ERROR_REASON_UNSPECIFIED") is Reason.UNKNOWN
    assert as_reason(Reason.INTERNAL) is Reason.INTERNAL
    with pytest.raises(ValueError):
        RouteSessionError(_shard("e", 0, 4), "keepalive-ish text", "x")


# --- the worker fills the fields (fake-model workers, no GGUF) -----------------------------

def _hop(w) -> pb.ChainHop:
    with WorkerClient(w.target) as c:
        cap = c.capability()
    return pb.ChainHop(endpoint=w.target, range=cap.identity.range,
                       compatibility_fingerprint=cap.identity.compatibility_fingerprint)


def _head_error(head, hops, step_timeout=20.0) -> pb.ShardError:
    with head.client() as c, c.open_session(downstream=hops, step_timeout=step_timeout) as s:
        with pytest.raises(ShardError) as ei:
            s.prefill_generate([256, *b"hello"], 64)
    return ei.value.proto


@pytest.mark.native
def test_a_dead_tail_is_named_in_the_fields(native_bin):
    ws = [start_fake(native_bin, "--layers", r) for r in ("0:4", "4:8")]
    try:
        hop = _hop(ws[1])
        ws[1].kill()
        e = _head_error(ws[0], [hop])
        assert e.reason == pb.ERROR_REASON_UNAVAILABLE and e.session_terminated, e
        assert (e.failed_endpoint, e.failed_start, e.failed_end) == (ws[1].target, 4, 8), e
    finally:
        for w in ws:
            w.kill()


@pytest.mark.native
def test_the_farthest_failed_shard_is_kept_through_a_middle_shard(native_bin):
    ws = [start_fake(native_bin, "--layers", r) for r in ("0:3", "3:5", "5:8")]
    try:
        hops = [_hop(ws[1]), _hop(ws[2])]
        ws[2].kill()
        e = _head_error(ws[0], hops)
        assert (e.failed_endpoint, e.failed_start, e.failed_end) == (ws[2].target, 5, 8), e
        assert ws[1].target in e.message and ws[2].target in e.message   # for people: both hops
    finally:
        for w in ws:
            w.kill()


@pytest.mark.native
def test_a_frozen_tail_is_peer_silent(native_bin):
    """SIGSTOP the tail: the head's keepalive on its hop expires (about 1.5 s), and the head
    answers PEER_SILENT naming the tail, well inside the client's own 20 s step deadline."""
    ws = [start_fake(native_bin, "--layers", r) for r in ("0:4", "4:8")]
    try:
        hop = _hop(ws[1])
        with ws[0].client() as c, c.open_session(downstream=[hop]) as s:   # the head's link is up
            assert len(s.prefill_generate([256, *b"hi"], 4)) == 4
            s.release()
        ws[1].proc.send_signal(signal.SIGSTOP)
        try:
            e = _head_error(ws[0], [hop])
        finally:
            ws[1].proc.send_signal(signal.SIGCONT)
        assert e.reason == pb.ERROR_REASON_PEER_SILENT and e.grpc_code == grpc.StatusCode.UNAVAILABLE.value[0], e
        assert (e.failed_endpoint, e.failed_start, e.failed_end) == (ws[1].target, 4, 8), e
    finally:
        for w in ws:
            w.kill()
