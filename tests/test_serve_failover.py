"""`dgr serve --standby`: failover behind the API users call. A shard that dies while a client
streams an answer is replaced by a standby worker: the request restarts from token zero on the
new route (prompt plus the tokens already sent are prefilled again), the stream goes on, and the
client receives exactly the text of an uninterrupted run, nothing lost or repeated. Fake-model
workers: seconds, no GGUF."""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest

from dgr.serve.server import Gateway
from fakeroute import start_fake

pytestmark = pytest.mark.native

MODEL = "fake-8"
ARGS = dict(model=MODEL, prompt="tell me about shards", max_tokens=300, temperature=0, extra_body={"ignore_eos": True})


def _workers(native_bin):
    # head, tail, and a standby for the tail's range; a small per-decode delay keeps the answer
    # running while the test kills the tail
    return [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "2") for r in ("0:4", "4:8", "4:8")]


def test_a_dead_tail_is_replaced_mid_stream_without_losing_a_token(native_bin):
    ws = _workers(native_bin)
    head, tail, spare = ws
    try:
        with Gateway([head.target, tail.target], model_id=MODEL, standby=[spare.target]) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
            ref = c.completions.create(**ARGS)
            assert ref.usage.completion_tokens == 300
            parts, killed = [], False
            for chunk in c.completions.create(stream=True, **ARGS):
                parts.append(chunk.choices[0].text)
                if len(parts) == 40 and not killed:
                    tail.kill()
                    killed = True
            assert killed
            assert "".join(parts) == ref.choices[0].text          # nothing lost, nothing repeated
            health = httpx.get(gw.url + "/health", timeout=10).json()
            assert health["failovers"] == 1 and health["failed_shards"] == [tail.target], health
            assert health["route"] == [head.target, spare.target], health
            prom = httpx.get(gw.url + "/metrics", timeout=10).text
            assert "dgr_gateway_failovers 1.0" in prom and "dgr_gateway_restarted_requests 1.0" in prom, prom
            after = c.completions.create(**ARGS)                  # later requests use the new route
            assert after.choices[0].text == ref.choices[0].text
    finally:
        for w in ws:
            w.kill()


def test_without_a_standby_left_the_stream_ends_with_an_error_event(native_bin):
    """The standby is gone too: no route can be formed, and the stream ends with the API's
    error event (502 route_error semantics), never a silent cut."""
    ws = _workers(native_bin)
    head, tail, spare = ws
    try:
        with Gateway([head.target, tail.target], model_id=MODEL, standby=[spare.target]) as gw:
            spare.kill()
            with httpx.stream("POST", gw.url + "/v1/completions", json={**{k: v for k, v in ARGS.items()
                                                                            if k != "extra_body"},
                                                                         "ignore_eos": True, "stream": True},
                              timeout=60) as r:
                assert r.status_code == 200
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 20:
                        tail.kill()
            body = "\n".join(lines)
            assert '"error"' in body and "route_error" in body, body[-800:]
    finally:
        for w in ws:
            w.kill()


def test_concurrent_streams_all_survive_one_failover(native_bin):
    """Four clients stream at once when the tail dies: every answer completes with the text of an
    uninterrupted run, the gateway forms one new route (not one per request), and no session is
    left on the surviving workers."""
    import asyncio
    import time

    ws = _workers(native_bin)
    head, tail, spare = ws
    prompts = [f"stream number {i}" for i in range(4)]
    try:
        with Gateway([head.target, tail.target], model_id=MODEL, standby=[spare.target]) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
            refs = [c.completions.create(**{**ARGS, "prompt": p}).choices[0].text for p in prompts]
            ac = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
            seen = {"n": 0}

            async def one(p: str) -> str:
                parts = []
                async for chunk in await ac.completions.create(stream=True, **{**ARGS, "prompt": p}):
                    parts.append(chunk.choices[0].text)
                    seen["n"] += 1
                    if seen["n"] == 80:
                        tail.kill()
                return "".join(parts)

            async def main() -> list[str]:
                return await asyncio.gather(*(one(p) for p in prompts))

            got = asyncio.run(main())
            assert got == refs
            health = httpx.get(gw.url + "/health", timeout=10).json()
            assert health["failovers"] == 1 and health["failed_shards"] == [tail.target], health
            for w in (head, spare):
                with w.client() as wc:
                    end = time.monotonic() + 10
                    while wc.load().active_sessions:
                        assert time.monotonic() < end, f"{w.target} kept sessions"
                        time.sleep(0.02)
    finally:
        for w in ws:
            w.kill()


def test_a_request_that_arrives_just_after_the_head_died_is_answered(native_bin):
    """The head is killed between two requests: no session has noticed yet, so the route still
    names it. The next request's prompt is tokenized (and its chat template applied) by a worker
    that answers, the tail or a standby of the same recipe, and its session fails over to the
    standby head: the client gets the uninterrupted answer, not a 502 (found by the chaos soak)."""
    ws = [start_fake(native_bin, "--layers", r, "--fake-delay-ms", "1") for r in ("0:4", "4:8", "0:4")]
    head, tail, spare = ws
    try:
        with Gateway([head.target, tail.target], model_id=MODEL, standby=[spare.target]) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
            args = dict(ARGS, max_tokens=20)
            ref = c.completions.create(**args)
            chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
            head.kill()
            assert c.completions.create(**args).choices[0].text == ref.choices[0].text
            again = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                              temperature=0, extra_body={"ignore_eos": True})
            assert again.choices[0].message.content == chat.choices[0].message.content
            assert httpx.get(gw.url + "/health", timeout=10).json()["failed_shards"] == [head.target]
    finally:
        for w in ws:
            w.kill()


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of ``pid``'s child processes, from /proc."""
    from pathlib import Path

    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append((int(d.name), cmd))
    return out


@pytest.mark.native
def test_local_standby_takes_over_a_killed_local_worker(native_bin):
    """`dgr serve --model/--split --local-standby`: a second worker per range on this machine;
    the route's tail killed, the gateway answers on head + standby tail, the same text."""
    import os
    import re
    import signal
    import sys

    from dgr.serve.server import free_port

    env = {**os.environ, "DGR_WORKER_BIN": str(native_bin / "dgr-worker")}
    p = subprocess.Popen([sys.executable, "-c", "from dgr.main import main; main()", "serve", "--fake", "--split",
                          "0:4,4:8", "--port", str(free_port()), "--max-sessions", "2", "--local-standby"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        lines = []
        for _ in range(100):
            line = p.stderr.readline()
            lines.append(line)
            if not line or "serving " in line:
                break
        assert any("standbys 0:4 at" in ln and "4:8 at" in ln for ln in lines), "".join(lines)
        url = re.search(r"at (http://\S+)/v1", lines[-1]).group(1)
        ask = dict(model="fake", prompt="spare", max_tokens=24, temperature=0)
        before = httpx.post(url + "/v1/completions", json=ask, timeout=30).json()["choices"][0]["text"]
        tails = sorted(pid for pid, cmd in _children(p.pid) if "dgr-worker" in cmd and "4:8" in cmd)
        assert len(tails) == 2, _children(p.pid)
        os.kill(tails[0], signal.SIGKILL)          # the route's tail (started before its standby)
        after = httpx.post(url + "/v1/completions", json=ask, timeout=30).json()["choices"][0]["text"]
        assert after == before
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["failovers"] >= 1 and len(health["failed_shards"]) == 1, health
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(30)
    assert p.returncode == 0
