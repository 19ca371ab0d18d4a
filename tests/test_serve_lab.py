"""`dgr serve --lab`: the gateway runs here, the route's workers on two simulated hosts (their
namespaces, mTLS on every hop); an OpenAI client gets an answer equal to the same request over a
local fake route, the route view names both lab hosts, and Ctrl-C stops the workers it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dgr.lab import system as sx  # noqa: E402
from dgr.lab.hosts import Lab, LabConfig  # noqa: E402
from dgr.serve.server import Gateway, free_port  # noqa: E402
from fakeroute import start_fake  # noqa: E402

pytestmark = [pytest.mark.lab, pytest.mark.native]


@pytest.fixture
def lab(native_bin):
    reason = sx.preflight()
    if reason:
        pytest.skip(reason)
    with Lab.up(LabConfig(hosts=2, name="sv1")) as lab:
        yield lab
    assert [n for n in sx.netns_list() if n.startswith(f"{sx.NETNS_PREFIX}sv1-")] == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _ask(url: str) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hello lab"}],
                                  max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    return r.choices[0].message.content


def _announced(p: subprocess.Popen) -> list[str]:
    """`dgr serve`'s stderr lines up to the one announcing it serves (bounded)."""
    lines = []
    for _ in range(200):
        line = p.stderr.readline()
        if not line:
            break
        lines.append(line)
        if "serving " in line:
            break
    assert any("serving " in ln for ln in lines), "".join(lines)
    return lines


def test_serve_over_lab_hosts(lab, native_bin):
    env = {**os.environ, "DGR_WORKER_BIN": str(native_bin / "dgr-worker")}
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", "from dgr.main import main; main()", "serve", "--lab", "sv1",
                          "--fake", "--port", str(port), "--max-sessions", "4"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        lines = _announced(p)
        hosts_line = next(ln for ln in lines if "route on lab" in ln)
        assert "h1 0:4" in hosts_line and "h2 4:8" in hosts_line
        url = re.search(r"at (http://\S+)/v1", lines[-1]).group(1)
        answer = _ask(url)
        view = httpx.get(url + "/api/route", timeout=10).json()
        shards = view["shards"]
        assert len(shards) == 2
        ips = {h.ip for h in lab.hosts}
        assert all(s["endpoint"].split(":")[0] in ips for s in shards), shards
        worker_pids = [pid for h in lab.hosts for pid in lab.host_pids(h)]
        assert worker_pids
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(30)
    assert p.returncode == 0
    assert all(not _alive(pid) for pid in worker_pids)
    # the same request over a local fake route gives the same answer
    ws = [start_fake(native_bin, "--layers", r) for r in ("0:4", "4:8")]
    try:
        with Gateway([w.target for w in ws], model_id="fake") as g:
            assert _ask(g.url) == answer
    finally:
        for w in ws:
            w.kill()


def test_serve_over_lab_hosts_with_standbys(lab, native_bin):
    """`--lab-standby`: a standby per range on the next lab host; every worker of h2 killed (the
    tail and the head's standby), the gateway answers on the route head@h1 + tail standby@h1."""
    env = {**os.environ, "DGR_WORKER_BIN": str(native_bin / "dgr-worker")}
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", "from dgr.main import main; main()", "serve", "--lab", "sv1",
                          "--fake", "--port", str(port), "--max-sessions", "4", "--lab-standby"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        lines = _announced(p)
        spare_line = next(ln for ln in lines if "standbys on lab" in ln)
        assert "h2 0:4" in spare_line and "h1 4:8" in spare_line
        url = re.search(r"at (http://\S+)/v1", lines[-1]).group(1)
        before = _ask(url)
        h2 = lab.host("h2")
        for pid in lab.host_pids(h2):
            os.kill(pid, signal.SIGKILL)
        assert _ask(url) == before
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["failovers"] >= 1 and all(ep.split(":")[0] == lab.host("h1").ip for ep in health["route"])
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(30)
    assert p.returncode == 0
