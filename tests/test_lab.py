"""`dgr lab`: simulated hosts. The `lab` tests create namespaces, links and cgroups (root) and
skip with the machine's reason where that is refused; the others need nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dgr.errors import DgrError
from dgr.lab import system as sx
from dgr.lab.hosts import Lab, LabConfig
from dgr.pki import describe, make_pki
from dgr.lab.proxy import Link, LinkSpec

_REASON = None


def lab_reason() -> str | None:
    global _REASON
    if _REASON is None:
        _REASON = sx.preflight() or ""
    return _REASON or None


@pytest.fixture
def lab_build(tmp_path, monkeypatch):
    """Labs of this test keep their state under tmp_path (never the checkout's build/lab)."""
    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path / "build"))
    reason = lab_reason()
    if reason:
        pytest.skip(reason)
    return tmp_path / "build" / "lab"


def leftovers(name: str) -> list[str]:
    out = [n for n in sx.netns_list() if n.startswith(f"{sx.NETNS_PREFIX}{name}-")]
    out += [n for n in sx.links_with_prefix(f"{sx.LINK_PREFIX}{name}")]
    for root in (sx.CGROUP_ROOT / "cpuset", sx.CGROUP_ROOT / "memory", sx.CGROUP_ROOT / "cpu", sx.CGROUP_ROOT):
        out += [str(p) for p in root.glob(f"{sx.CGROUP_PREFIX}{name}-*")]
    return out


# ---- no privileges needed ---------------------------------------------------------------------

def test_config_validation():
    nan, inf = float("nan"), float("inf")
    for bad in (LabConfig(name="Bad!"), LabConfig(hosts=0), LabConfig(loss=1.0), LabConfig(rtt_ms=-1),
                LabConfig(hosts=2, cpus=["0"]), LabConfig(shaper="tc"),
                # out of range or not a number: refused before anything is created
                LabConfig(rtt_ms=nan), LabConfig(rtt_ms=1e9), LabConfig(jitter_ms=inf), LabConfig(loss=nan),
                LabConfig(rate_mbit=inf), LabConfig(rate_mbit=nan), LabConfig(rate_mbit=1e9),
                LabConfig(threads=100_000), LabConfig(memory_mb=1 << 40),
                LabConfig(hosts=2, cpus=["0", "x"]), LabConfig(hosts=2, cpus=["0", ""]),
                LabConfig(hosts=2, cpus=["0", "3-1"]), LabConfig(hosts=1, cpus=["0;1"]),
                LabConfig(subnet="abc"), LabConfig(subnet="::/24"), LabConfig(subnet="198.18.7.0/25"),
                LabConfig(subnet="10.0.0.0/24"), LabConfig(subnet="198.18.300.0/24")):
        with pytest.raises(DgrError):
            bad.validate()
    LabConfig(hosts=2, cpus=["0,2-3", "1"], rtt_ms=60_000, rate_mbit=100_000, threads=256,
              subnet="198.19.7.0/24").validate()


def test_unequal_hosts_config():
    from dgr.lab.config import per_host

    assert per_host("2", "--threads", int) == (2, None)
    assert per_host("2;1;-", "--memory-mb", int) == (None, [2, 1, None])
    assert per_host(None, "--cpu-quota", float) == (None, None)
    assert per_host("1; 0.4", "--cpu-quota", float) == (None, [1.0, 0.4])
    for text in ("x", "1;y", "-"):
        with pytest.raises(DgrError):
            per_host(text, "--threads", int)
    for bad in (LabConfig(hosts=2, threads_per_host=[1]), LabConfig(hosts=2, threads_per_host=[1, 0]),
                LabConfig(hosts=2, threads_per_host=[1, None]),
                LabConfig(hosts=2, memory_mb_per_host=[64, 8]), LabConfig(hosts=2, cpu_quota=[1.0]),
                LabConfig(hosts=2, cpu_quota=[1.0, 0.001]), LabConfig(hosts=2, cpu_quota=[1.0, float("nan")]),
                LabConfig(hosts=2, cpu_quota=[1.0, float("inf")])):
        with pytest.raises(DgrError):
            bad.validate()
    cfg = LabConfig(hosts=3, threads=2, memory_mb=512, threads_per_host=[2, 1, 1], memory_mb_per_host=[900, None, 300],
                    cpu_quota=[None, 0.5, 0.25])
    cfg.validate()
    assert [cfg.host_threads(i, "0") for i in range(3)] == [2, 1, 1]
    assert [cfg.host_memory_mb(i) for i in range(3)] == [900, None, 300]
    assert [cfg.host_cpu_quota(i) for i in range(3)] == [None, 0.5, 0.25]
    plain = LabConfig(hosts=2, memory_mb=256)
    assert plain.host_threads(1, "0,1") == 2 and plain.host_memory_mb(1) == 256 and plain.host_cpu_quota(0) is None


def test_cpus_checked_before_anything_exists():
    from dgr.lab.hosts import _check_cpus

    with pytest.raises(DgrError, match="only 2 CPU"):
        _check_cpus(LabConfig(hosts=3, cores_per_host=5), [0, 1])
    with pytest.raises(DgrError, match=r"h2: CPU\(s\) \[9\]"):
        _check_cpus(LabConfig(hosts=2, cpus=["0", "9"]), [0, 1])
    _check_cpus(LabConfig(hosts=3, cores_per_host=2), [0, 1])     # hosts may share the CPUs


def test_link_spec_refuses_what_timers_cannot_take():
    for bad in (LinkSpec(delay_ms=float("nan")), LinkSpec(jitter_ms=float("inf")), LinkSpec(rto_ms=-1),
                LinkSpec(delay_ms=1e12), LinkSpec(loss=float("nan"))):
        with pytest.raises(ValueError):
            bad.validate()


def test_pki_host_and_client_certs(tmp_path):
    pki = make_pki(tmp_path, {"h1": ["198.18.3.2"], "h2": ["198.18.3.3"]})
    h1 = describe(pki.hosts["h1"].cert)
    assert h1["san_ips"] == ["198.18.3.2"]
    assert set(h1["extended_key_usage"]) == {"serverAuth", "clientAuth"}   # server, and client on the chain hop
    cl = describe(pki.client_cert)
    assert cl["extended_key_usage"] == ["clientAuth"] and cl["san_ips"] == []
    assert oct(pki.hosts["h1"].key.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(DgrError):
        make_pki(tmp_path / "x", {"h1": ["not-an-ip"]})
    # a host name names files: nothing may land outside the directory
    for bad in ("../evil", "a/b", ".hidden", "", "x" * 64):
        with pytest.raises(DgrError, match="host name"):
            make_pki(tmp_path / "y", {bad: ["198.18.3.2"]})
    assert not (tmp_path / "evil.pem").exists()
    with pytest.raises(DgrError, match="1..3650 days"):
        make_pki(tmp_path / "z", {"h1": ["198.18.3.2"]}, days=10 ** 9)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DgrError, match="cannot write the certificates"):
        make_pki(blocker / "pki", {"h1": ["198.18.3.2"]})


async def _echo_server() -> tuple[asyncio.AbstractServer, int]:
    async def echo(r, w):
        while data := await r.read(4096):
            w.write(data)
            await w.drain()
        w.close()
    srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


def test_proxy_keeps_order_under_jitter_and_loss():
    async def main():
        srv, port = await _echo_server()
        link = Link(LinkSpec(delay_ms=2, jitter_ms=2, loss=0.3, rto_ms=5), seed=1)
        psrv = await asyncio.start_server(lambda r, w: link.handle(r, w, ("127.0.0.1", port)), "127.0.0.1", 0)
        pport = psrv.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", pport)
        sent = b"".join(i.to_bytes(4, "big") for i in range(2000))
        got = bytearray()
        for k in range(0, len(sent), 800):
            w.write(sent[k:k + 800])
            await w.drain()
            await asyncio.sleep(0)
        while len(got) < len(sent):
            got += await asyncio.wait_for(r.read(65536), 10)
        w.close()
        psrv.close()
        srv.close()
        return bytes(got), link.counters
    got, c = asyncio.run(main())
    assert got == b"".join(i.to_bytes(4, "big") for i in range(2000))
    assert c.lost_chunks > 0 and c.bytes_up == c.bytes_down == 8000


def test_proxy_delay_and_blackhole():
    async def main():
        srv, port = await _echo_server()
        link = Link(LinkSpec(delay_ms=20))
        psrv = await asyncio.start_server(lambda r, w: link.handle(r, w, ("127.0.0.1", port)), "127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", psrv.sockets[0].getsockname()[1])
        t0 = time.monotonic()
        w.write(b"ping")
        assert await asyncio.wait_for(r.readexactly(4), 5) == b"ping"
        rtt = time.monotonic() - t0
        link.blackhole(True)
        w.write(b"held")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.readexactly(4), 0.3)
        link.blackhole(False)
        assert await asyncio.wait_for(r.readexactly(4), 5) == b"held"
        w.close()
        psrv.close()
        srv.close()
        return rtt
    assert asyncio.run(main()) >= 0.040      # 20 ms each way: never faster than the link


def test_lab_refusal_is_one_clear_line(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from dgr.main import app

    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(sx, "preflight", lambda: "this machine refuses network namespaces: Operation not permitted")
    res = CliRunner().invoke(app, ["lab", "up", "--hosts", "2", "--name", "rf"])
    assert res.exit_code != 0
    assert isinstance(res.exception, sx.LabRefused) and "refuses network namespaces" in str(res.exception)
    assert not (tmp_path / "lab" / "rf.json").exists()


# ---- the lab lane: root, namespaces -------------------------------------------------------------

@pytest.mark.lab
def test_up_confines_shapes_and_down_leaves_nothing(lab_build):
    lab = Lab.up(LabConfig(hosts=2, name="pt1", memory_mb=128, rate_mbit=500, rtt_ms=20))
    try:
        h1, h2 = lab.hosts
        assert h1.ip != h2.ip and all(x.ip.startswith("198.1") for x in (h1, h2))
        p = lab.run("h2", ["sh", "-c", "ip -o -4 addr show dev eth0; grep Cpus_allowed_list /proc/self/status; "
                                      "cat /proc/self/cgroup"])
        assert p.returncode == 0 and h2.ip in p.stdout
        assert p.stdout.split("Cpus_allowed_list:")[1].split()[0] == h2.cpus
        if lab.state["cgroup_mode"] == "v1":
            assert f"memory:/{sx.CGROUP_PREFIX}pt1-h2" in p.stdout
            assert Path(h2.cgroups[1], "memory.limit_in_bytes").read_text().strip() == str(128 << 20)
        q = sx.run(["tc", "qdisc", "show", "dev", h1.veth]).stdout
        assert "tbf" in q and "500Mbit" in q
        # an echo service in h2, reached from h1 through the link proxy (20 ms RTT)
        srv = lab.spawn("h2", [sys.executable, "-c", (
            "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f"s.bind(('{h2.ip}',7007));s.listen();print('up',flush=True)\n"
            "while True:\n c,_=s.accept()\n d=c.recv(64)\n c.sendall(d);c.close()")], stdout=subprocess.PIPE)
        assert srv.stdout.readline().strip() == b"up"
        ep = lab.expose("h2", 7007)
        assert ep.startswith(h2.ip + ":") and ep != f"{h2.ip}:7007"
        probe = ("import socket,sys,time;h,p=sys.argv[1].rsplit(':',1);t=time.monotonic();"
                 "c=socket.create_connection((h,int(p)),timeout=5);c.sendall(b'x');d=c.recv(8);"
                 "print(d.decode(),time.monotonic()-t)")
        out = lab.run("h1", [sys.executable, "-c", probe, ep]).stdout.split()
        assert out[0] == "x" and float(out[1]) >= 0.020
        assert lab.blackhole("h2", True) == 1
        bh = lab.run("h1", [sys.executable, "-c", probe.replace("timeout=5", "timeout=0.5"), ep])
        assert bh.returncode != 0           # nothing comes back through a blackholed link
        lab.blackhole("h2", False)
        pids = lab.host_pids(lab.host("h2"))
        assert srv.pid in pids
        st = lab.status()
        assert all(h["netns_present"] for h in st["hosts"]) and st["bridge_present"]
    finally:
        res = lab.down()
    assert res["left"] == [] and leftovers("pt1") == []
    assert not sx.alive(srv.pid)
    assert not (lab_build / "pt1.json").exists() and not (lab_build / "pt1").exists()


def test_unequal_hosts_get_their_own_quota_threads_and_memory(lab_build):
    """A fast and a slow host on one machine: h2's CPU time is capped (cgroup cpu quota), and a
    busy loop there is held back by it (the kernel's throttled time grows; h1's does not exist)."""
    cfg = LabConfig(hosts=2, name="pt7", cpus=["0", "0"], threads_per_host=[2, 1], memory_mb_per_host=[256, 128],
                    cpu_quota=[None, 0.2])
    if not sx.cpu_quota_available(sx.cgroup_mode()):
        with pytest.raises(DgrError, match="cpu controller"):
            Lab.up(cfg)
        assert leftovers("pt7") == []
        pytest.skip(f"no cgroup cpu controller here ({sx.cgroup_mode()}): the refusal is what was checked")
    lab = Lab.up(cfg)
    try:
        h1, h2 = lab.hosts
        assert (h1.threads, h2.threads) == (2, 1) and (h1.memory_mb, h2.memory_mb) == (256, 128)
        assert (h1.cpu_quota, h2.cpu_quota) == (None, 0.2)
        def quota_us(cg: str) -> tuple[int, int] | None:
            p = Path(cg)
            if (p / "cpu.max").exists():
                q, period = (p / "cpu.max").read_text().split()
                return None if q == "max" else (int(q), int(period))
            if (p / "cpu.cfs_quota_us").exists():
                q = int((p / "cpu.cfs_quota_us").read_text())
                return None if q < 0 else (q, int((p / "cpu.cfs_period_us").read_text()))
            return None
        capped = [cg for cg in h2.cgroups if quota_us(cg)]
        assert [quota_us(cg) for cg in capped] == [(20000, 100000)]
        assert not any(quota_us(cg) for cg in h1.cgroups)
        cg = capped[0]
        before = sx.cpu_throttled_us(cg)
        assert before is not None
        # half a second of CPU work (bounded: 2 s at most) where only 20 ms per 100 ms may run
        r = lab.run("h2", [sys.executable, "-c", "import time\nt=time.process_time()\ne=time.monotonic()+2\n"
                                                 "while time.process_time()-t<0.5 and time.monotonic()<e: pass"])
        assert r.returncode == 0
        assert sx.cpu_throttled_us(cg) > before, "the quota held the busy loop back"
        assert lab.status()["hosts"][1]["cpu_quota"] == 0.2
    finally:
        res = lab.down()
    assert res["left"] == [] and leftovers("pt7") == []


@pytest.mark.lab
def test_failed_up_rolls_back(lab_build):
    with pytest.raises(DgrError, match="not available"):
        Lab.up(LabConfig(hosts=2, name="pt2", cpus=["0", "999"]))
    assert leftovers("pt2") == [] and not (lab_build / "pt2.json").exists()


@pytest.mark.lab
def test_down_after_the_owner_was_killed(lab_build, tmp_path):
    """A process that brought a lab up and started a service in it dies by SIGKILL (no cleanup
    ran); `dgr lab down` still removes everything, the service included."""
    env = {**os.environ, "DGR_BUILD_DIR": str(lab_build.parent)}
    code = ("from dgr.lab.hosts import Lab, LabConfig;import sys,time;"
            "lab=Lab.up(LabConfig(hosts=1,name='pt3'));lab.spawn('h1',['sleep','600']);"
            "print('ready',flush=True);time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout.readline().strip() == b"ready"
    finally:
        p.kill()
        p.wait(10)
    assert leftovers("pt3")                   # the crash left the lab up
    lab = Lab.load("pt3")
    sleeper = [x["pid"] for x in lab.state["processes"]]
    r = subprocess.run([sys.executable, "-m", "dgr.main", "lab", "down", "--name", "pt3"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert leftovers("pt3") == [] and not any(sx.alive(x) for x in sleeper)


@pytest.mark.lab
def test_down_stops_a_recorded_process_not_yet_inside_its_host(lab_build):
    """A process spawn() started that has not joined its host's namespace and cgroups yet (a
    signal right after the start: seen once in CI, a `sleep` left in the cgroup) is stopped by
    its recorded pid and start time; a recorded pid that another process now holds is left alone."""
    lab = Lab.up(LabConfig(hosts=1, name="pt6"))
    outside = subprocess.Popen(["sleep", "600"])   # stands for a child before it joined the host
    other = subprocess.Popen(["sleep", "600"])     # stands for a reused pid: another start time
    try:
        lab.record(lab.hosts[0], outside.pid, ["sleep", "600"])
        lab.state["processes"].append({"host": "h1", "pid": other.pid, "argv": ["sleep", "600"],
                                       "start": (sx.start_ticks(other.pid) or 0) - 1})
        lab.down()
        assert outside.wait(10) == -signal.SIGTERM
        assert other.poll() is None
    finally:
        for p in (outside, other):
            p.kill()
            p.wait(10)
    assert leftovers("pt6") == []


@pytest.mark.lab
def test_context_manager_tears_down_on_sigterm(lab_build):
    env = {**os.environ, "DGR_BUILD_DIR": str(lab_build.parent)}
    code = ("from dgr.lab.hosts import Lab, LabConfig;import time\n"
            "with Lab.up(LabConfig(hosts=2,name='pt4')) as lab:\n"
            " lab.spawn('h2',['sleep','600']);print('ready',flush=True);time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout.readline().strip() == b"ready"
    assert leftovers("pt4")
    p.send_signal(signal.SIGTERM)
    p.wait(60)
    assert leftovers("pt4") == [] and not (lab_build / "pt4.json").exists()


@pytest.mark.lab
def test_cli_up_status_exec_down(lab_build):
    env = {**os.environ, "DGR_BUILD_DIR": str(lab_build.parent)}

    def dgr(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dgr.main", *args], env=env, capture_output=True, text=True,
                              timeout=120)
    r = dgr("lab", "up", "--hosts", "2", "--name", "pt5", "--rtt-ms", "4")
    assert r.returncode == 0, r.stderr
    try:
        st = json.loads(dgr("lab", "status", "--name", "pt5", "--json").stdout)["labs"][0]
        assert [h["name"] for h in st["hosts"]] == ["h1", "h2"] and st["shaping"]["rtt_ms"] == 4
        assert st["shaping"]["delay_mechanism"] in ("proxy", "netem")
        r = dgr("lab", "exec", "h2", "--name", "pt5", "--", "sh", "-c", "exit 7")
        assert r.returncode == 7
        r = dgr("lab", "up", "--hosts", "2", "--name", "pt5")
        assert r.returncode == 1 and "already up" in r.stderr and "Traceback" not in r.stderr
    finally:
        r = dgr("lab", "down", "--name", "pt5")
    assert r.returncode == 0 and leftovers("pt5") == []


def test_cli_ca_for_physical_machines(tmp_path):
    from typer.testing import CliRunner

    from dgr.main import app

    r = CliRunner().invoke(app, ["lab", "ca", "--host", "a=10.0.0.11", "--host", "b=10.0.0.12,10.0.1.12",
                                 "--out", str(tmp_path / "pki")])
    assert r.exit_code == 0, r.output
    assert describe(tmp_path / "pki" / "b.pem")["san_ips"] == ["10.0.0.12", "10.0.1.12"]
    assert (tmp_path / "pki" / "client.pem").is_file() and (tmp_path / "pki" / "ca.pem").is_file()
    r = CliRunner().invoke(app, ["lab", "ca", "--host", "a", "--out", str(tmp_path / "x")])
    assert r.exit_code != 0 and "NAME=IP" in str(r.exception)


def test_cli_per_host_values_are_checked_before_anything_exists(tmp_path):
    env = {**os.environ, "DGR_BUILD_DIR": str(tmp_path / "build")}
    for args, words in ((["--threads", "1;x"], "not a number"), (["--threads", "1;-"], "needs a thread count"),
                        (["--cpu-quota", "0"], "--cpu-quota must be"), (["--hosts", "3", "--memory-mb", "64;64"],
                                                                 "2 values for 3 hosts")):
        r = subprocess.run([sys.executable, "-m", "dgr.main", "lab", "up", "--name", "pt8", *args], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert not (tmp_path / "build" / "lab" / "pt8.json").exists()
