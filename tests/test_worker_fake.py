"""dgr-worker in fake-model mode: real worker processes, the real gRPC service, sessions,
batching and errors, without GGUF files (DGR-007/008/012). Budgets, limits, metrics and the
process lifecycle: test_worker_fake_lifecycle.py."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path

import grpc
import numpy as np
import pytest

from dgr.shard.v1 import shard_runtime_pb2 as pb
from dgr.protocol.client import Sampling, ShardError, WorkerError, boundary_rows, sampled
from fakeroute import N_GEN, fake_worker_binary, poll, run_alone, start_worker as start

pytestmark = pytest.mark.native

PROMPTS = [[(7 * i + j * 13) % 250 + 1 for j in range(3 + i)] for i in range(8)]


@pytest.fixture(scope="module")
def worker_bin(native_bin: Path) -> Path:
    return fake_worker_binary(native_bin)


@pytest.fixture(scope="module")
def worker(worker_bin: Path):
    with start(worker_bin, "--session-ttl-s", "600") as w:
        yield w


def test_capability_health_reflection(worker):
    c = worker.client()
    cap = c.capability()
    assert cap.schema_version == pb.SCHEMA_VERSION_V1
    ident = cap.identity
    assert (ident.range.start, ident.range.end, ident.n_layer) == (0, 8, 8)
    assert ident.head and ident.tail and ident.n_vocab == 320 and ident.compatibility_fingerprint
    assert cap.capacity.max_sessions == 16 and cap.capacity.kv_cells > 0
    assert list(cap.capacity.compressions) == [pb.COMPRESSION_NONE]
    assert c.health() == "SERVING"
    assert c.health("dgr.shard.v1.ShardRuntimeService") == "SERVING"
    # server reflection lists the service (ServerReflectionRequest{list_services: ""}, hand-encoded)
    from dgr.protocol.channel import open_channel

    with open_channel(c.target) as ch:
        call = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                request_serializer=lambda b: b, response_deserializer=lambda b: b)
        raw = b"".join(call(iter([b"\x3a\x00"]), timeout=5))
    assert b"dgr.shard.v1.ShardRuntimeService" in raw
    assert c.tokenize("hi") == [104, 105]
    assert c.detokenize([104, 105]) == b"hi"
    with pytest.raises(WorkerError) as ei:
        c.detokenize([100000])
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and "TOKEN_OUT_OF_VOCAB" in ei.value.details


def test_eight_concurrent_sessions_match_alone(worker):
    c = worker.client()
    alone = [run_alone(c, p) for p in PROMPTS]
    assert len({tuple(a) for a in alone}) == 8  # the prompts really differ
    base = c.load().kv_cells_used
    batches0 = c.metric("dgr_batches_total")
    steps0 = c.metric("dgr_steps_total")
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def run(i):
        try:
            barrier.wait(10)
            results[i] = run_alone(c, PROMPTS[i])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [results[i] for i in range(8)] == alone
    # batching was in use: fewer decode calls than steps
    batches = c.metric("dgr_batches_total") - batches0
    steps = c.metric("dgr_steps_total") - steps0
    assert batches < steps, (batches, steps)
    assert poll(lambda: c.load().kv_cells_used == base, what="KV back to its level")


@pytest.mark.parametrize("how", ["cancel", "release"])
def test_stop_one_of_eight_mid_generation(worker, how):
    c = worker.client()
    alone = [run_alone(c, p) for p in PROMPTS]
    base = c.load().kv_cells_used
    victim = 3
    results: dict[int, list[int]] = {}
    stopped: dict[int, BaseException] = {}
    errors: list[BaseException] = []
    halfway = threading.Event()

    def run(i):
        try:
            with c.open_session(f"{how}-{i}") as s:
                first = s.prefill(PROMPTS[i])
                out = [first]
                tok = first
                for k in range(N_GEN):
                    if i == victim and k == N_GEN // 2:
                        halfway.set()
                        if how == "release":
                            c.release(s.session_id)
                        else:
                            poll(lambda: stopped.get(-1), what="cancel sent")
                    try:
                        tok = s.decode(tok)
                    except (ShardError, WorkerError) as exc:
                        stopped[i] = exc
                        return
                    out.append(tok)
                results[i] = out
                s.release()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    halfway.wait(20)
    if how == "cancel":
        assert c.cancel(f"{how}-{victim}").cancelled
        stopped[-1] = True  # type: ignore[assignment]
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i in range(8):
        if i != victim:
            assert results[i] == alone[i], i
    exc = stopped[victim]
    if how == "cancel":
        assert isinstance(exc, ShardError) and exc.reason == pb.ERROR_REASON_CANCELLED and exc.terminated
    else:
        assert isinstance(exc, ShardError) and exc.reason == pb.ERROR_REASON_SESSION_RELEASED
    assert poll(lambda: c.load().kv_cells_used == base and c.load().active_sessions == 0,
                what="KV and sessions back to their level")


def _expect(fn, reason):
    with pytest.raises(ShardError) as ei:
        fn()
    assert ei.value.reason == reason, ei.value
    assert not ei.value.terminated
    return ei.value


def test_error_cases_leave_the_session_and_others_intact(worker):
    c = worker.client()
    other_alone = run_alone(c, PROMPTS[5])
    other = c.open_session("bystander")
    other_out = [other.prefill(PROMPTS[5])]

    s = c.open_session("victim")
    first = s.prefill([1, 2, 3])
    # wrong fingerprint
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.header.compatibility_fingerprint = "0" * 64
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_FINGERPRINT_MISMATCH)
    # wrong range
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.header.shard_range.end = 4
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_RANGE_MISMATCH)
    # position gap
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.header.positions.start += 2
    bad.step.header.positions.end += 2
    bad.step.header.cache_expectation.kind = pb.CACHE_EXPECTATION_KIND_UNSPECIFIED
    e = _expect(lambda: s.exchange(bad), pb.ERROR_REASON_POSITION_GAP)
    assert e.proto.cached_positions == 3 and e.grpc_code == grpc.StatusCode.ABORTED.value[0]
    # cache expectation at the wrong position
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.header.cache_expectation.position = 7
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_CACHE_MISS)
    # token out of vocabulary
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.tokens.token_ids[0] = 320
    bad.step.header.payload_checksum.value = 0
    bad.step.header.payload_checksum.algorithm = pb.CHECKSUM_ALGORITHM_UNSPECIFIED
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_TOKEN_OUT_OF_VOCAB)
    # checksum mismatch
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.header.payload_checksum.value ^= 1
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_BAD_BUNDLE)
    # a bundle to a head
    bad = s._input_frame(pb.PHASE_DECODE, None, np.zeros((1, 8), np.float32), True)
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_ROLE_MISMATCH)
    # decode with two rows, prefill above the chunk limit
    bad = s._input_frame(pb.PHASE_DECODE, [first, first], None, True)
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_CHUNK_TOO_LARGE)
    big = s._input_frame(pb.PHASE_PREFILL, [1] * 300, None, True)
    e = _expect(lambda: s.exchange(big), pb.ERROR_REASON_CHUNK_TOO_LARGE)
    assert e.proto.limit == c.capability().capacity.max_prefill_chunk_tokens
    # step out of order
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.header.step = 5
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_STEP_OUT_OF_ORDER)
    # schema version unset
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.header.schema_version = 0
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_SCHEMA_UNSUPPORTED)
    # unsupported compression
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.header.compression = pb.COMPRESSION_F16
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_UNSUPPORTED_COMPRESSION)
    # bad sampling
    bad = s._input_frame(pb.PHASE_DECODE, [first], None, True)
    bad.step.sampling.CopyFrom(pb.SamplingParams(mode=pb.SAMPLING_MODE_STOCHASTIC, temperature=0))
    _expect(lambda: s.exchange(bad), pb.ERROR_REASON_BAD_REQUEST)

    # the session is intact: it continues exactly like an undisturbed one
    out = [first, *s.generate(first, 5)]
    ref = run_alone(c, [1, 2, 3], n=5)
    assert out == ref
    # duplicate step: the stored response comes back, nothing re-executed
    last = s.step - 1
    dup = pb.SessionRequest(fast_decode=pb.FastDecodeFrame(session_id="victim", route_epoch=1, step=last,
                                                           position=s.positions - 1, token_id=out[-2]))
    # the gauge settles once the reference session's release is published: the bystander's
    # and the victim's positions stay held
    positions_before = len(PROMPTS[5]) + s.positions
    assert poll(lambda: c.load().kv_cells_used == positions_before, what="KV of the two live sessions")
    r = s.exchange(dup)
    assert r.header.replayed and sampled(r) == out[-1]
    assert c.load().kv_cells_used == positions_before
    # another stream naming the live session id is refused (ownership), the victim untouched
    s2 = c.open_session("victim", epoch=2)
    _expect(lambda: s2.prefill([9, 9]), pb.ERROR_REASON_SESSION_NOT_OWNED)
    # a newer epoch on the owner's own stream supersedes; the older epoch is then stale
    s.epoch, s.step, s.positions = 2, 0, 0
    s.prefill([9, 9])
    old = s._input_frame(pb.PHASE_DECODE, [1], None, True)
    old.step.header.route_epoch = 1
    e = _expect(lambda: s.exchange(old), pb.ERROR_REASON_STALE_EPOCH)
    assert e.proto.current_epoch == 2
    # unknown session; released session
    ghost = c.open_session("ghost")
    ghost.step = 1
    ghost.positions = 0
    bad = ghost._input_frame(pb.PHASE_DECODE, [1], None, True)
    bad.step.header.cache_expectation.kind = pb.CACHE_EXPECTATION_KIND_UNSPECIFIED
    _expect(lambda: ghost.exchange(bad), pb.ERROR_REASON_UNKNOWN_SESSION)
    s.release()
    again = s._input_frame(pb.PHASE_DECODE, [1], None, True)
    _expect(lambda: s.exchange(again), pb.ERROR_REASON_SESSION_RELEASED)
    # the bystander never noticed
    other_out += other.generate(other_out[0], N_GEN)
    assert other_out == other_alone
    for x in (other, s, s2, ghost):
        x.close()


def test_truncate_and_sampling_are_deterministic(worker):
    c = worker.client()
    with c.open_session() as s:
        first = s.prefill([5, 6, 7])
        gen = s.generate(first, 6)
        s.truncate(4)  # keep the prompt (0..2) and `first` (3)
        assert s.positions == 4
        again = s.generate(gen[0], 5)
        assert again == gen[1:]
    samp = Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, seed=1234, top_logprobs=3, ignore_eog=True)
    a = run_alone(c, [1, 2, 3], sampling=samp)
    b = run_alone(c, [1, 2, 3], sampling=samp)
    g = run_alone(c, [1, 2, 3])
    assert a == b and a != g
    with c.open_session(sampling=samp) as s:
        s.prefill([1, 2])
        r = s.decode_step(3)
        tok = r.tail.tokens[0]
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob


def test_range_split_matches_whole_model(worker_bin, worker):
    """A head [0,4) and a tail [4,8) worker chained by boundary bundles give the whole model's tokens."""
    whole = run_alone(worker.client(), PROMPTS[2], n=8)
    with start(worker_bin, "--layers", "0:4") as hw, start(worker_bin, "--layers", "4:8") as tw:
        h, t = hw.client(), tw.client()
        assert h.capability().identity.head and not h.capability().identity.tail
        assert t.capability().identity.tail and not t.capability().identity.head
        hs, ts = h.open_session("r"), t.open_session("r")
        rows = boundary_rows(hs.prefill_chunk(PROMPTS[2], sample=False), 8)
        out = [sampled(ts.prefill_chunk(rows=rows))]
        for _ in range(8):
            r = hs.exchange(hs._input_frame(pb.PHASE_DECODE, [out[-1]], None, False))
            hs._applied(r)
            rows = boundary_rows(r, 8)
            out.append(sampled(ts._applied(ts.exchange(ts._input_frame(pb.PHASE_DECODE, None, rows, True)))))
        assert out == whole
        # a step spread over two frames (fragments 0 and 1): one answer, after the second frame,
        # with the token the whole model gives next
        r = hs.exchange(hs._input_frame(pb.PHASE_DECODE, [out[-1]], None, False))
        hs._applied(r)
        rows = boundary_rows(r, 8)
        full = ts._input_frame(pb.PHASE_DECODE, None, rows, True)
        t0 = full.step.bundle.tensors[0]
        data = t0.fragments[0].data
        parts = []
        for k, piece in enumerate((data[:16], data[16:])):
            f = pb.SessionRequest()
            f.CopyFrom(full)
            tt = f.step.bundle.tensors[0]
            tt.fragment_count = 2
            del tt.fragments[:]
            tt.fragments.add(index=k, data=piece)
            f.step.header.payload_checksum.value = zlib.crc32(piece)
            parts.append(f)
        ts.send(parts[0])
        r = ts.exchange(parts[1])
        assert r.header.cached_positions == ts.positions + 1
        assert sampled(ts._applied(r)) == run_alone(worker.client(), PROMPTS[2], n=9)[-1]
        # malformed / oversized bundles to the tail: structured errors, the session continues
        good = ts._input_frame(pb.PHASE_DECODE, None, rows, True)
        bad = pb.SessionRequest()
        bad.CopyFrom(good)
        bad.step.bundle.tensors[0].shape[1] = 9
        _expect(lambda: ts.exchange(bad), pb.ERROR_REASON_BAD_BUNDLE)
        bad.CopyFrom(good)
        bad.step.bundle.tensors[0].checksum.value ^= 1
        _expect(lambda: ts.exchange(bad), pb.ERROR_REASON_BAD_BUNDLE)
        bad.CopyFrom(good)
        bad.step.bundle.tensors[0].byte_size = 1 << 40
        _expect(lambda: ts.exchange(bad), pb.ERROR_REASON_MESSAGE_TOO_LARGE)
        bad = ts._input_frame(pb.PHASE_DECODE, [1], None, True)
        _expect(lambda: ts.exchange(bad), pb.ERROR_REASON_ROLE_MISMATCH)
        ts._applied(ts.exchange(good))  # still fine
        hs.close()
        ts.close()


def test_async_client_eight_sessions_match_sync(worker):
    import asyncio

    from dgr.protocol.client import AsyncWorkerClient

    ref = [run_alone(worker.client(), p, n=8) for p in PROMPTS]

    async def main():
        async with AsyncWorkerClient(worker.target) as c:
            async def one(p):
                s = await c.open_session()
                first = await s.prefill(p)
                out = [first, *await s.generate(first, 8)]
                await s.close()
                return out
            return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(main()) == ref


def _rpc_status_class():
    """google.rpc.Status built from its descriptor in a private pool (the test needs no
    googleapis package, and registers nothing in the default pool)."""
    from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(any_pb2.DESCRIPTOR.serialized_pb)
    f = descriptor_pb2.FileDescriptorProto(name="google/rpc/status.proto", package="google.rpc", syntax="proto3",
                                           dependency=["google/protobuf/any.proto"])
    m = f.message_type.add(name="Status")
    m.field.add(name="code", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
                label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    m.field.add(name="message", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    m.field.add(name="details", number=3, type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
                label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED, type_name=".google.protobuf.Any")
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("google.rpc.Status"))


def test_error_status_details_carry_the_shard_error(worker):
    """A failing RPC also sends the standard grpc-status-details-bin trailer: a google.rpc.Status
    whose details hold the ShardError (what grpcurl and gRPC rich-error clients read); the
    dgr-error-bin trailer stays."""
    from dgr.shard.v1 import shard_runtime_pb2_grpc as rpc

    with grpc.insecure_channel(worker.target) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            rpc.ShardRuntimeServiceStub(ch).Detokenize(pb.DetokenizeRequest(token_ids=[10**6]), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    md = dict(ei.value.trailing_metadata())
    status = _rpc_status_class().FromString(md["grpc-status-details-bin"])
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert status.message == ei.value.details()
    assert len(status.details) == 1 and status.details[0].type_url.endswith("/dgr.shard.v1.ShardError")
    err = pb.ShardError.FromString(status.details[0].value)
    assert err.reason == pb.ERROR_REASON_TOKEN_OUT_OF_VOCAB and "1000000" in err.message
    assert pb.ShardError.FromString(md["dgr-error-bin"]) == err
