"""Route formation, registration payloads and relay framing (meshnet_adapter)."""

from __future__ import annotations

import socket
import threading

import pytest

from dgr.errors import DgrError
from dgr.gguf.recipe import Registry, RegistryEntry, RuntimeRecipe
from meshnet_adapter.registration import Capacity, make_registration
from dgr.protocol.relay import FrameDecoder, FrameTooLarge, encode_frame
from meshnet_adapter.routing import NoRoute, form_routes

ART = "a" * 64
REGISTRY = Registry((
    RegistryEntry("llama-cert", "certified", "llama", 1, "f32", "f16", "llama-unified-layer-filtered", 1,
                  ("cpu", "vulkan"), evidence="evidence/TEST"),
    RegistryEntry("llama-f16wire", "dark", "llama", 1, "f16", "f16", "llama-unified-layer-filtered", 1, ("cpu",)),
))


def recipe(**kw) -> RuntimeRecipe:
    base = dict(artifact_id=ART, tokenizer_digest="b" * 64, arch_adapter="llama", arch_adapter_version=1,
                pin_commit="0c1e57098bba43ac29e6e3b677cdceebdd22334f", patch_digest="sha256:" + "c" * 64)
    base.update(kw)
    return RuntimeRecipe(**base)


def reg(node, start, end, *, n_layer=30, free=4, **kw):
    return make_registration(node_id=node, endpoint=f"127.0.0.1:{5000 + start}", recipe=recipe(**kw),
                             architecture="llama", n_layer=n_layer, start=start, end=end,
                             capacity=Capacity(max_sessions=4, active_sessions=4 - free), registry=REGISTRY)


def test_registration_payload_carries_validated_recipe():
    r = reg("n1", 0, 15)
    assert r.fingerprint == recipe().fingerprint() and r.certified and r.is_head and not r.is_tail
    payload = r.to_json()
    assert payload["artifact_id"] == ART and payload["start"] == 0 and payload["end"] == 15
    assert payload["capacity"]["max_sessions"] == 4
    with pytest.raises(DgrError, match="invalid served range"):
        reg("n1", 10, 40)


def test_complete_contiguous_routes_best_first():
    cov = [reg("a", 0, 15), reg("b", 15, 30), reg("c", 0, 7), reg("d", 7, 23), reg("e", 23, 30)]
    routes = form_routes(cov, ART)
    assert not isinstance(routes, NoRoute)
    assert [r.split for r in routes] == ["0:15,15:30", "0:7,7:23,23:30"]
    assert all(len({s.fingerprint for s in r.shards}) == 1 for r in routes)


def test_gap_is_explained():
    res = form_routes([reg("a", 0, 10), reg("b", 15, 30)], ART)
    assert isinstance(res, NoRoute)
    assert any("layers not covered by usable shards: [10:15)" in r for r in res.reasons)


def test_fingerprint_mismatch_never_combines():
    res = form_routes([reg("a", 0, 15), reg("b", 15, 30, tokenizer_digest="d" * 64)], ART)
    assert isinstance(res, NoRoute)
    assert any("incompatible recipe fingerprints" in r for r in res.reasons)


def test_dark_recipe_never_routable():
    res = form_routes([reg("a", 0, 15, activation_dtype="f16"), reg("b", 15, 30, activation_dtype="f16")], ART)
    assert isinstance(res, NoRoute)
    assert any("dark (uncertified) recipe" in r for r in res.reasons)


def test_capacity_exhausted_is_explained():
    res = form_routes([reg("a", 0, 15, free=0), reg("b", 15, 30)], ART)
    assert isinstance(res, NoRoute)
    assert any("no free session capacity: a[0:15]" in r for r in res.reasons)
    assert form_routes([], ART).reasons == ("no shard of this artifact is registered",)


def test_relay_carries_protobuf_frames_as_opaque_bytes():
    from dgr.shard.v1 import shard_runtime_pb2 as pb

    msgs = []
    for i in range(50):
        m = pb.SessionRequest()
        if i % 2:
            m.fast_decode.session_id = f"s{i}"
            m.fast_decode.route_epoch = 1
            m.fast_decode.step = i
            m.fast_decode.position = 64 + i
            m.fast_decode.token_id = 1000 + i
        else:
            m.step.header.session_id = f"s{i}"
            m.step.header.step = i
            t = m.step.bundle.tensors.add()
            t.name = "residual"
            t.shape.extend([i + 1, 576])
            t.fragments.add().data = bytes([i % 251]) * (i * 4 * 97)
        msgs.append(m)
    frames = [m.SerializeToString() for m in msgs]
    a_client, a_relay = socket.socketpair()
    b_relay, b_server = socket.socketpair()

    def relay():  # a dumb byte pump: never parses frames
        while chunk := a_relay.recv(1000):
            b_relay.sendall(chunk)
        b_relay.shutdown(socket.SHUT_WR)

    def client():
        for f in frames:
            a_client.sendall(encode_frame(f))
        a_client.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=relay, daemon=True)
    c = threading.Thread(target=client, daemon=True)
    t.start()
    c.start()
    b_server.settimeout(10)
    dec, got = FrameDecoder(), []
    while chunk := b_server.recv(333):
        got.extend(dec.feed(chunk))
    t.join(5)
    assert got == frames and dec.pending == 0
    assert [pb.SessionRequest.FromString(g) for g in got] == msgs


def test_relay_rejects_oversized_frames():
    with pytest.raises(FrameTooLarge):
        encode_frame(b"x" * 11, max_frame=10)
    dec = FrameDecoder(max_frame=10)
    with pytest.raises(FrameTooLarge, match="11 bytes exceeds"):
        dec.feed(encode_frame(b"x" * 11))
