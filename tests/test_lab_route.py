"""Routes across simulated hosts with fake-model workers: the head forwards to the tail over mTLS
between namespaces, the relay path runs across hosts too, and the lab leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from dgr.lab import system as sx
from dgr.lab.hosts import Lab, LabConfig
from dgr.lab.route import LabRoute
from fakeroute import poll

pytestmark = [pytest.mark.lab, pytest.mark.native]


@pytest.fixture
def lab(tmp_path, monkeypatch, native_bin):
    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("DGR_WORKER_BIN", str(native_bin / "dgr-worker"))
    reason = sx.preflight()
    if reason:
        pytest.skip(reason)
    with Lab.up(LabConfig(hosts=2, name="pr1", rtt_ms=2)) as lab:
        yield lab
    assert [n for n in sx.netns_list() if n.startswith(f"{sx.NETNS_PREFIX}pr1-")] == []
    assert sx.links_with_prefix(f"{sx.LINK_PREFIX}pr1") == []


def _tokens(endpoints, tls, chain=None, hops=None):
    from dgr.route.driver import RouteDriver, Sampling

    async def go():
        d = await RouteDriver(endpoints, tls=tls, chain=chain, timeout=30, hops=hops).connect()
        try:
            r = await d.generate([256, *b"lab"], max_tokens=12, sampling=Sampling(ignore_eog=True), stop_on_eog=False)
            return r, d.mode
        finally:
            await d.close()
    return asyncio.run(go())


def test_chained_mtls_and_relay_across_hosts(lab, native_bin, monkeypatch):
    from dgr.protocol.client import WorkerClient, WorkerError
    from dgr.route.supervisor import WorkerProcess

    monkeypatch.setattr("dgr.route.local.ensure_worker", lambda *a, **k: native_bin / "dgr-worker")
    with LabRoute(lab, None, [(0, 4), (4, 8)], fake=True, relay=True) as lr:
        h1, h2 = lab.hosts
        assert [p.host.name for p in lr.placed] == ["h1", "h2"]
        assert lr.placed[1].direct.startswith(h2.ip + ":")
        # every endpoint handed out goes through the link proxy (rtt 2 ms), not to the worker port
        assert all(p.endpoint != p.direct for p in lr.placed)
        r, mode = _tokens(lr.endpoints, lr.tls)
        assert mode == "chained" and r.error is None and len(r.tokens) == 12
        rr, rmode = _tokens(lr.relay_endpoints, lr.tls)
        assert rmode == "stepwise" and rr.error is None and rr.tokens == r.tokens
        # with the egress in h1 (mTLS on its gRPC side and on the relay), the relayed route stays chained
        assert lr.relay_hops[0] == "" and lr.relay_hops[1].startswith(h1.ip + ":")
        rc, cmode = _tokens(lr.relay_endpoints, lr.tls, hops=lr.relay_hops)
        assert cmode == "chained" and rc.error is None and rc.tokens == r.tokens
        # the head forwarded over the network (TLS), its chain counter moved
        with WorkerClient(lr.placed[0].direct, credentials=lr.tls.grpc_credentials()) as c:
            sent = sum(m.value for m in c.metrics().samples if m.name == "dgr_chain_frames_sent_total")
        assert sent > 0
        # a client without a certificate is refused (mTLS)
        with WorkerClient(lr.placed[1].direct, timeout=3) as plain, pytest.raises(WorkerError):
            plain.capability()
        # the worker runs inside h2: its pid is in h2's namespace and CPU set
        assert lr.placed[1].worker.pid in lab.host_pids(h2)
        # the proxies write their counters once a second: wait (bounded) for a write after the traffic
        poll(lambda: sum(s.get("connections", 0) for s in lab.proxy_stats()) > 0, deadline_s=10,
             what="the link proxies' connection counters")
    # the same tokens as one whole fake worker on loopback
    with WorkerProcess.start(["--fake-model"], binary=native_bin / "dgr-worker") as w:
        whole, _ = _tokens([w.target], None)
    assert whole.tokens == r.tokens


def test_lab_route_split_auto_plans_from_each_hosts_probe(tmp_path, lab_worker):
    """`dgr lab route --split auto`: every host probes itself in its namespace, the planner picks
    the hosts, their order, the ranges and the groups; the route runs as planned."""
    import json

    from typer.testing import CliRunner

    from dgr.gguf.synth import SynthSpec, synthesize
    from dgr.main import app

    model = synthesize(SynthSpec(n_layer=6, dtype="q8_0"), tmp_path / "m.gguf")
    with Lab.up(LabConfig(hosts=2, name="pr3", cpu_quota=[None, 0.5])):
        r = CliRunner().invoke(app, ["lab", "route", "--name", "pr3", "--model", str(model), "--split", "auto",
                                     "--sessions", "2", "--max-tokens", "4", "--json"])
        assert r.exit_code == 0, r.output
        doc = json.loads(r.output[r.output.index("{"):])
        plan = doc["plan"]
        assert [p["host"] for p in doc["placement"]] == plan["hosts"]
        assert ",".join(p["range"] for p in doc["placement"]) == plan["split"]
        groups = plan["prediction"]["groups"]
        if len(plan["hosts"]) > 1:
            assert f"--pipeline-groups {groups}" in doc["placement"][0]["command"]
        assert doc["route"]["ok"] and all(len(s["tokens"]) == 4 for s in doc["route"]["sessions"])
        r = CliRunner().invoke(app, ["lab", "route", "--name", "pr3", "--model", str(model), "--split", "auto",
                                     "--hosts", "h1"])
        assert r.exit_code != 0 and "leave out --hosts" in str(r.exception)
