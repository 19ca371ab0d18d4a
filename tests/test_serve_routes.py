"""Several routes behind one `dgr serve` endpoint, over fake-model workers: replicas of one model
share its requests by free slots, a route that fails its health check is taken out and put back,
several models are listed and picked by `model`, and the command line refuses what cannot work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dgr.errors import DgrError  # noqa: E402
from dgr.serve.engine import Admission, GatewayError  # noqa: E402
from dgr.serve.pool import Routes  # noqa: E402
from dgr.serve.server import Gateway, RouteSpec  # noqa: E402
from fakeroute import poll, start_fake  # noqa: E402


# -- the choice of route, without workers ----------------------------------------------------

def _engine(model: str, slots: int, queue: int = 4):
    return SimpleNamespace(model_id=model, admission=Admission(slots, queue), router=None,
                           driver=SimpleNamespace(endpoints=[f"{model}:{slots}"], shards=[]), failovers=0)


def test_pick_spreads_by_free_slots_then_takes_turns():
    a, b = _engine("m", 4), _engine("m", 2)
    routes = Routes([a, b])
    got = []
    for _ in range(6):
        got.append(routes.take(routes.pick("m")).name)
    # a has 4 slots, b 2: a until both have 2 free, then turns, then a (b full)
    assert got == ["route-1", "route-1", "route-2", "route-1", "route-2", "route-1"]
    assert [r.assigned for r in routes.routes] == [4, 2]
    for r in routes.routes:
        while r.assigned:
            routes.give_back(r)
    assert [r.assigned for r in routes.routes] == [0, 0]


def test_pick_skips_a_route_out_of_service_unless_every_route_is():
    routes = Routes([_engine("m", 4), _engine("m", 4)])
    routes.routes[0].healthy = False
    assert {routes.pick("m").name for _ in range(3)} == {"route-2"}
    routes.routes[1].healthy = False          # every route out: the one with the most room still takes it
    routes.take(routes.routes[1])
    assert routes.pick("m").name == "route-1"


def test_pick_by_model_and_unknown_model():
    routes = Routes([_engine("a", 2), _engine("b", 2), _engine("a", 2)])
    assert routes.models == ["a", "b"]
    assert routes.pick("b").name == "route-2"
    with pytest.raises(GatewayError) as e:
        routes.pick("c")
    assert e.value.status == 404 and e.value.code == "model_not_found" and "'a', 'b'" in e.value.message


# -- over fake-model workers -------------------------------------------------------------------

@pytest.fixture(scope="module")
def replicas(native_bin):
    ws = [start_fake(native_bin, "--max-sessions", "2", "--fake-delay-ms", "3") for _ in range(2)]
    yield ws
    for w in ws:
        w.kill()


def _client(gw) -> "openai.OpenAI":
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _answer(gw, model="fake-8", prompt="replica", n=12) -> str:
    return _client(gw).completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0).choices[0].text


def test_replicas_share_requests_and_answer_alike(replicas):
    with Gateway([replicas[0].target], model_id="fake-8") as one:
        want = _answer(one, n=300)    # long enough (about 1 s) that all four streams overlap, even on a busy host
    with Gateway(routes=[RouteSpec((w.target,), "fake-8") for w in replicas], health_interval=0.2) as gw:
        assert [m.id for m in _client(gw).models.list().data] == ["fake-8"]
        c = _client(gw)
        streams = []
        for _ in range(4):   # each stream is running (its first token read) before the next starts
            s = c.completions.create(model="fake-8", prompt="replica", max_tokens=300, temperature=0, stream=True)
            first = next(iter(s))
            streams.append((s, first.choices[0].text))
        h = httpx.get(gw.url + "/health").json()
        assert [r["assigned"] for r in h["routes"]] == [2, 2]      # 2 slots each: 2 and 2
        texts = [first + "".join(ch.choices[0].text for ch in s) for s, first in streams]
        assert texts == [want] * 4
        # a stream's account closes just after its last event: polled
        def ended():
            got = httpx.get(gw.url + "/health").json()
            return got if all(r["assigned"] == 0 and r["running"] == 0 for r in got["routes"]) else None
        h = poll(ended, 10, "the streams' end")
        assert [r["requests"] for r in h["routes"]] == [2, 2] and all(r["healthy"] for r in h["routes"])
        m = httpx.get(gw.url + "/metrics").text
        assert 'dgr_gateway_route_healthy{model="fake-8",route="route-2"} 1.0' in m
        v = httpx.get(gw.url + "/api/route").json()
        assert [r["name"] for r in v["routes"]] == ["route-1", "route-2"]
        assert [[s["endpoint"] for s in r["shards"]] for r in v["routes"]] == [[w.target] for w in replicas]


def test_a_stopped_replica_is_taken_out_and_put_back(replicas):
    with Gateway(routes=[RouteSpec((w.target,), "fake-8") for w in replicas], health_interval=0.2) as gw:
        victim = replicas[1].proc.pid
        os.kill(victim, signal.SIGSTOP)
        try:
            poll(lambda: not httpx.get(gw.url + "/health").json()["routes"][1]["healthy"], 10, "route-2 out")
            h = httpx.get(gw.url + "/health").json()
            assert h["routes"][1]["reason"] and h["status"] == "ok"
            before = h["routes"][1]["requests"]
            for _ in range(3):                       # every request goes to the healthy route, and succeeds
                assert _answer(gw, n=4)
            assert httpx.get(gw.url + "/health").json()["routes"][1]["requests"] == before
            assert 'dgr_gateway_route_healthy{model="fake-8",route="route-2"} 0.0' in httpx.get(gw.url + "/metrics").text
        finally:
            os.kill(victim, signal.SIGCONT)
        poll(lambda: httpx.get(gw.url + "/health").json()["routes"][1]["healthy"], 10, "route-2 back")


def test_two_models_behind_one_endpoint(native_bin, replicas):
    other = start_fake(native_bin, "--n-vocab", "400")
    try:
        with Gateway(routes=[RouteSpec((replicas[0].target,), "small"), RouteSpec((other.target,), "big")]) as gw:
            c = _client(gw)
            assert sorted(m.id for m in c.models.list().data) == ["big", "small"]
            r = c.completions.create(model="big", prompt="x", max_tokens=3, temperature=0)
            assert r.model == "big" and r.usage.completion_tokens == 3
            assert [x["requests"] for x in httpx.get(gw.url + "/health").json()["routes"]] == [0, 1]
            with pytest.raises(openai.NotFoundError) as e:
                c.completions.create(model="huge", prompt="x", max_tokens=3)
            assert "'small', 'big'" in str(e.value)
        # one name over two different models is refused at start
        with pytest.raises(DgrError, match="serve different models"):
            Gateway(routes=[RouteSpec((replicas[0].target,), "m"), RouteSpec((other.target,), "m")]).start()
    finally:
        other.kill()


def test_a_worker_in_two_routes_is_refused(replicas):
    with pytest.raises(DgrError, match="in route 1 and in route 2"):
        Gateway(routes=[RouteSpec((replicas[0].target,)), RouteSpec((replicas[0].target,))]).start()


def test_an_unreachable_route_fails_the_start_naming_it(replicas):
    with pytest.raises(DgrError, match=r"route 2 \(127\.0\.0\.1:1\)"):
        Gateway(routes=[RouteSpec((replicas[0].target,)), RouteSpec(("127.0.0.1:1",))], timeout=2).start()


# -- the command line ---------------------------------------------------------------------------

@pytest.mark.parametrize("items, message", [
    (["=127.0.0.1:1"], "model name"),
    ([" m =127.0.0.1:1"], "model name"),
    (["m="], "expected"),
    (["127.0.0.1:1,,127.0.0.1:2"], "expected"),
    ([""], "expected"),
])
def test_route_option_refuses_malformed_items(items, message):
    from dgr.commands.serve import parse_routes

    with pytest.raises(DgrError, match=message):
        parse_routes(items)


def test_route_option_parses_names_and_orders():
    from dgr.commands.serve import parse_routes

    got = parse_routes(["a=h1:1,h2:2", "h3:3"])
    assert got == [RouteSpec(("h1:1", "h2:2"), "a"), RouteSpec(("h3:3",), None)]


@pytest.mark.parametrize("args, message", [
    (["--route", "127.0.0.1:1", "--shard", "127.0.0.1:2"], "not both"),
    (["--route", "127.0.0.1:1", "--route", "127.0.0.1:2", "--standby", "127.0.0.1:2"], "already a --shard"),
    (["--route", "127.0.0.1:1", "--split", "0:4,4:8"], "not both kinds"),
    (["--route", "127.0.0.1:1", "--standby", "127.0.0.1:1"], "already a --shard"),
])
def test_serve_refuses_route_combinations(args, message):
    p = subprocess.run([sys.executable, "-c", "from dgr.main import main; main()", "serve", "--port", "0", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_several_routes_fail_over_to_the_shared_standbys(native_bin):
    """`--standby` with several routes: every route's failover pool. Two replica routes (head and
    tail each) and one standby tail; route 2's tail dies while a client streams from it, and the
    answer goes on through the standby, identical to an uninterrupted run."""
    ws = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "2") for r in ("0:4", "4:8", "0:4", "4:8", "4:8")]
    h1, t1, h2, t2, spare = ws
    args = dict(model="fake-8", prompt="standbys", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    try:
        routes = [RouteSpec((h1.target, t1.target), "fake-8"), RouteSpec((h2.target, t2.target), "fake-8")]
        with Gateway(routes=routes, standby=[spare.target]) as gw:
            c = _client(gw)
            ref = c.completions.create(**args).choices[0].text
            s = c.completions.create(stream=True, **args)
            parts = [next(iter(s)).choices[0].text]
            h = httpx.get(gw.url + "/health").json()
            busy = [r for r in h["routes"] if r["running"] == 1]
            assert len(busy) == 1, h["routes"]
            victim = t1 if busy[0]["name"] == "route-1" else t2
            victim.kill()
            parts += [ch.choices[0].text for ch in s]
            assert "".join(parts) == ref                      # nothing lost, nothing repeated
            h = httpx.get(gw.url + "/health").json()
            failed = [r for r in h["routes"] if r["failovers"]]
            assert len(failed) == 1 and failed[0]["failed_shards"] == [victim.target], h["routes"]
            assert failed[0]["route"][1] == spare.target
            assert all(r["failovers"] == 0 for r in h["routes"] if r is not failed[0])
    finally:
        for w in ws:
            w.kill()


def test_port_0_announces_the_port_it_listens_on(native_bin):
    import os
    import re
    import signal
    import sys

    env = {**os.environ, "DGR_WORKER_BIN": str(native_bin / "dgr-worker")}
    p = subprocess.Popen([sys.executable, "-c", "from dgr.main import main; main()", "serve", "--fake", "--port", "0"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        line = next(ln for ln in iter(p.stderr.readline, "") if "serving " in ln or not ln)
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1))
        assert port > 0 and httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["status"] == "ok"
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(30)
