"""Attacker tests of session ownership on the real dgr-worker (fake model, seconds).

A session belongs to the stream that opened it. Another stream that learns or guesses its id
gets ERROR_REASON_SESSION_NOT_OWNED for every kind of frame: it reads no stored answer, applies
nothing, cannot supersede the session with a newer epoch while its owner is connected, and the
owner's generation is bit-for-bit what it would have been alone. The owner itself may replay its
last step only with the same frame content.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from dgr.protocol.client import ShardError, sampled
from dgr.route.supervisor import WorkerProcess
from dgr.shard.v1 import shard_runtime_pb2 as pb
from fakeroute import poll

pytestmark = pytest.mark.native

PROMPT = [256, *b"the owner's secret prompt"]
N = 6


@pytest.fixture(scope="module")
def worker(native_bin: Path):
    env = os.environ.get("DGR_WORKER_BIN")
    binary = Path(env) if env else native_bin / "dgr-worker"
    with WorkerProcess.start(["--fake-model", "--max-sessions", "8"], binary=binary) as w:
        yield w


def _alone(c, sid: str) -> list[int]:
    with c.open_session(sid) as s:
        out = [s.prefill(PROMPT)]
        out += s.generate(out[0], N)
        s.release()
        return out


def _refused(stream, req) -> pb.ShardError:
    r = stream.exchange(req, raise_errors=False)
    assert r.WhichOneof("result") == "error", r          # never a stored tail / boundary
    assert not r.header.replayed
    assert r.error.reason == pb.ERROR_REASON_SESSION_NOT_OWNED, r.error
    assert r.error.grpc_code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert not r.error.session_terminated
    return r.error


def test_second_stream_cannot_read_or_alter_a_live_session(worker):
    c = worker.client()
    alone = _alone(c, "reference")
    owner = c.open_session("victim-1")
    first = owner.prefill(PROMPT)
    out = [first, *owner.generate(first, 3)]
    # the exact frame the owner sent for its last step (an attacker who sniffed or guessed it)
    last = pb.SessionRequest(fast_decode=pb.FastDecodeFrame(
        session_id="victim-1", route_epoch=1, step=owner.step - 1, position=owner.positions - 1, token_id=out[-2]))
    before = (c.metric("dgr_replayed_steps_total"), c.load().kv_cells_used, c.metric("dgr_steps_total"))

    thief = c.open_session("victim-1")
    _refused(thief, last)                                                   # replay of the stored answer
    nxt = pb.SessionRequest(fast_decode=pb.FastDecodeFrame(
        session_id="victim-1", route_epoch=1, step=owner.step, position=owner.positions, token_id=out[-1]))
    _refused(thief, nxt)                                                    # the next step (would append)
    full = thief._input_frame(pb.PHASE_DECODE, [out[-1]], None, True)
    full.step.header.step, full.step.header.positions.start = owner.step, owner.positions
    full.step.header.positions.end = owner.positions + 1
    full.step.header.cache_expectation.CopyFrom(pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_POSITION,
                                                                    position=owner.positions))
    _refused(thief, full)                                                   # a full StepFrame
    for phase in (pb.PHASE_TRUNCATE, pb.PHASE_RELEASE):                     # truncate / release it
        h = thief.header(phase, 0, 0, step=owner.step)
        _refused(thief, pb.SessionRequest(step=pb.StepFrame(header=h)))
    thief.epoch, thief.step, thief.positions = 7, 0, 0                      # supersede by a newer epoch
    _refused(thief, thief._input_frame(pb.PHASE_PREFILL, [1, 2], None, True))
    thief.close()

    # nothing was read, replayed or applied
    assert c.metric("dgr_replayed_steps_total") == before[0]
    assert c.load().kv_cells_used == before[1]
    assert c.metric("dgr_steps_total") == before[2]
    assert c.metric("dgr_sessions_not_owned_total") >= 6
    # and the owner goes on exactly as it would have alone
    out += owner.generate(out[-1], N - 3)
    assert out == alone
    owner.release()
    owner.close()


def test_owner_replay_only_with_identical_content(worker):
    c = worker.client()
    with c.open_session("victim-2") as s:
        first = s.prefill(PROMPT)
        tok = s.decode(first)
        dup = pb.SessionRequest(fast_decode=pb.FastDecodeFrame(
            session_id="victim-2", route_epoch=1, step=s.step - 1, position=s.positions - 1, token_id=first,
            request_id="another work id"))                                  # request_id is not content
        r = s.exchange(dup)
        assert r.header.replayed and sampled(r) == tok
        forged = pb.SessionRequest(fast_decode=pb.FastDecodeFrame(
            session_id="victim-2", route_epoch=1, step=s.step - 1, position=s.positions - 1, token_id=first + 1))
        with pytest.raises(ShardError) as ei:
            s.exchange(forged)
        assert ei.value.reason == pb.ERROR_REASON_STEP_OUT_OF_ORDER and "different frame" in str(ei.value)
        assert ei.value.proto.last_step == s.step - 1
        # the session is unchanged: the next step continues from the owner's state
        assert s.decode(tok) == _alone(c, "ref-2")[2]
        s.release()


def test_ended_owner_frees_the_id_for_a_new_epoch(worker):
    c = worker.client()
    owner = c.open_session("victim-3")
    owner.prefill(PROMPT)
    owner.cancel_stream()                                                   # owner gone (RST)
    nxt = c.open_session("victim-3", epoch=2)
    def opened():
        try:
            nxt.step, nxt.positions = 0, 0
            return nxt.prefill(PROMPT) is not None
        except ShardError as exc:                     # the owner's end not yet processed
            assert exc.reason in (pb.ERROR_REASON_SESSION_NOT_OWNED, pb.ERROR_REASON_CACHE_MISS,
                                  pb.ERROR_REASON_SESSION_RELEASED), exc
            return False

    assert poll(opened, what="a new epoch after the owner's stream ended")
    nxt.release()
    nxt.close()


@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff\x0f", b"\x0a\x10\x0a", b"\x12\x05\x0a\x03abc\xff"])
def test_undecodable_frame_ends_the_stream_invalid_argument(worker, payload):
    """Bytes that are not a SessionRequest end the stream with INVALID_ARGUMENT and a BAD_REQUEST
    ShardError (never OK, never UNIMPLEMENTED); the session bound to the stream is released and
    the worker serves on."""
    from test_worker_fake import _rpc_status_class

    c = worker.client()
    sessions = c.load().active_sessions
    from dgr.protocol.channel import open_channel

    opening = pb.SessionRequest(step=c.open_session(f"undecodable-{len(payload)}")._input_frame(pb.PHASE_PREFILL, [1, 2], None, True)
                                .step).SerializeToString()
    answers = []
    with open_channel(c.target) as ch, pytest.raises(grpc.RpcError) as ei:
        raw = ch.stream_stream("/dgr.shard.v1.ShardRuntimeService/Session",
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for a in raw(iter([opening, payload]), timeout=10):
            answers.append(pb.SessionResponse.FromString(a))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "undecodable frame" in ei.value.details()
    details = dict(ei.value.trailing_metadata())["grpc-status-details-bin"]
    err = pb.ShardError()
    _rpc_status_class().FromString(details).details[0].Unpack(err)
    assert err.reason == pb.ERROR_REASON_BAD_REQUEST and err.grpc_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert answers and answers[0].WhichOneof("result") == "tail"          # the opening frame was served
    assert poll(lambda: c.load().active_sessions == sessions, what="the bound session released")
    assert _alone(c, f"after-undecodable-{len(payload)}")                  # the worker serves on


UNARY_METHODS = ["GetCapability", "ReleaseSession", "CancelSession", "GetMetrics", "Tokenize", "Detokenize",
                 "ApplyChatTemplate"]


@pytest.mark.parametrize("method", UNARY_METHODS)
def test_undecodable_unary_request_is_invalid_argument(worker, method):
    """Bytes that are not the method's request answer INVALID_ARGUMENT with a BAD_REQUEST
    ShardError that names the expected message, for every unary RPC (never UNIMPLEMENTED: the
    method exists); the same RPC with a well-formed request still works."""
    from test_worker_fake import _rpc_status_class

    from dgr.protocol.channel import open_channel

    c = worker.client()
    with open_channel(c.target) as ch:
        raw = ch.unary_unary(f"/dgr.shard.v1.ShardRuntimeService/{method}",
                             request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for payload in (b"\xff\xff\xff\xff\x0f", b"\x0a\x10\x0a", b"\x12\x05\x0a\x03abc\xff"):
            with pytest.raises(grpc.RpcError) as ei:
                raw(payload, timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, payload, ei.value)
            assert f"undecodable request: {len(payload)} bytes that are not a dgr.shard.v1.{method}Request" \
                in ei.value.details()
            md = dict(ei.value.trailing_metadata())
            err = pb.ShardError()
            _rpc_status_class().FromString(md["grpc-status-details-bin"]).details[0].Unpack(err)
            assert err.reason == pb.ERROR_REASON_BAD_REQUEST
            assert pb.ShardError.FromString(md["dgr-error-bin"]) == err
        # the empty message is a valid request of every unary method: it is decoded and answered
        if method == "GetCapability":
            cap = pb.GetCapabilityResponse.FromString(raw(b"", timeout=10))
            assert cap.identity.n_layer == 8
        elif method == "Tokenize":
            ok = pb.TokenizeRequest(text="hi").SerializeToString()
            assert list(pb.TokenizeResponse.FromString(raw(ok, timeout=10)).token_ids) == [104, 105]
