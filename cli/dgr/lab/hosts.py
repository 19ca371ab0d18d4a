"""Simulated hosts on one machine: network namespaces joined by veth pairs to a bridge.

``Lab.up(config)`` creates, for a lab named NAME (1-6 lower-case letters/digits):

- a bridge ``dgl<NAME>br`` in the root namespace holding ``198.18.X.1/24`` (the machine's own
  side: the route driver runs here), X chosen so the /24 is unused on this machine;
- per host ``hI`` (I = 1..N): a network namespace ``dgrlab-<NAME>-hI`` with ``eth0`` at
  ``198.18.X.(I+1)`` (a veth pair, root side ``dgl<NAME>hI`` on the bridge) and ``lo`` up;
- per host a CPU set (cgroup v1/v2 cpuset where available, and always ``taskset``) and a memory
  limit (cgroup memory; the worker also gets ``--memory-budget-mb``), and a thread count;
- link shaping: rate by ``tc tbf`` on both ends of each veth; delay, jitter and loss by ``tc
  netem`` where the kernel has it, else by the userspace link proxy (:mod:`dgr.lab.proxy`) in
  front of each exposed service; the mechanism used is recorded;
- a throwaway CA with a certificate per host (SAN = its IP) and one for the driver (mTLS).

Everything created is appended to the state file ``build/lab/<NAME>.json`` *before* the next
step, so ``Lab.down`` (and ``dgr lab down``) removes exactly what the tool made, also after a
crash. Creation that fails or is interrupted rolls back. Used as a context manager, a lab is torn
down on exit, SIGINT and SIGTERM.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from .. import childproc
from ..errors import DgrError
from . import system as sx
from .config import LAB_NET, NAME_RE, STATE_SCHEMA, Host, LabConfig, lab_dir, parse_cpus  # noqa: F401

_log = logging.getLogger(__name__)


def _check_cpus(cfg: LabConfig, allowed: list[int]) -> None:
    """Refuses, before anything is created, CPUs this process may not use and more CPUs per host
    than there are (round robin would repeat CPUs within one host's set)."""
    for i, c in enumerate(cfg.cpus or [], 1):
        bad = [x for x in parse_cpus(c) if x not in allowed]
        if bad:
            raise DgrError(f"host h{i}: CPU(s) {bad} are not available here (allowed {allowed})")
    if not cfg.cpus and cfg.cores_per_host > len(allowed):
        raise DgrError(f"--cores-per-host {cfg.cores_per_host}: only {len(allowed)} CPU(s) are available here "
                       f"({allowed})", hint="hosts may share CPUs: give each its set with --cpus")


class Lab:
    """A set of simulated hosts (see the module doc). Load one that is up with :meth:`load`."""

    def __init__(self, state: dict[str, Any], path: Path) -> None:
        self.state = state
        self.path = path

    # ---- state ----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.state["name"]

    @property
    def dir(self) -> Path:
        return Path(self.state["dir"])

    @property
    def hosts(self) -> list[Host]:
        return [Host(**h) for h in self.state["hosts"]]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise DgrError(f"lab {self.name} has no host {name!r}", hint="hosts: " + ", ".join(h.name for h in self.hosts))

    @property
    def gateway(self) -> str:
        return self.state["gateway"]

    @property
    def shaping(self) -> dict[str, Any]:
        return self.state["shaping"]

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2, sort_keys=True))
        tmp.replace(self.path)

    def _created(self, kind: str, value: Any) -> None:
        self.state["created"].append([kind, value])
        self._save()

    @classmethod
    def load(cls, name: str = "lab") -> "Lab":
        path = lab_dir() / f"{name}.json"
        if not path.is_file():
            raise DgrError(f"lab {name!r} is not up (no {path})", hint="dgr lab up")
        return cls(json.loads(path.read_text()), path)

    @staticmethod
    def names() -> list[str]:
        d = lab_dir()
        return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []

    # ---- up -------------------------------------------------------------------------------

    @classmethod
    def up(cls, cfg: LabConfig) -> "Lab":
        cfg.validate()
        reason = sx.preflight()
        if reason:
            raise sx.LabRefused(f"cannot create simulated hosts: {reason}")
        _check_cpus(cfg, sorted(os.sched_getaffinity(0)))
        path = lab_dir() / f"{cfg.name}.json"
        if path.exists():
            raise DgrError(f"lab {cfg.name!r} is already up ({path})", hint=f"dgr lab down --name {cfg.name}")
        path.parent.mkdir(parents=True, exist_ok=True)
        d = lab_dir() / cfg.name
        state: dict[str, Any] = {"schema": STATE_SCHEMA, "name": cfg.name, "dir": str(d), "config": asdict(cfg),
                                 "created_at": time.time(), "owner_pid": os.getpid(), "created": [],
                                 "hosts": [], "proxies": [], "processes": []}
        lab = cls(state, path)
        lab._save()
        try:
            with lab._trap():
                lab._build(cfg)
        except BaseException:
            _log.warning("lab creation failed or was interrupted: removing what was created")
            lab.down()
            raise
        return lab

    def _build(self, cfg: LabConfig) -> None:
        st = self.state
        self.dir.mkdir(parents=True, exist_ok=True)
        self._created("dir", str(self.dir))
        net = self._pick_subnet(cfg)
        hosts_ip = list(net.hosts())
        st["subnet"], st["gateway"] = str(net), str(hosts_ip[0])
        allowed = sorted(os.sched_getaffinity(0))
        mode = sx.cgroup_mode()
        if any(q is not None for q in cfg.cpu_quota or []) and not sx.cpu_quota_available(mode):
            raise DgrError("--cpu-quota needs the cgroup cpu controller (v1: the cpu hierarchy with CFS bandwidth; "
                           f"v2: cpu enabled in {sx.CGROUP_ROOT}/cgroup.subtree_control); cgroups here: {mode}",
                           hint="give the hosts fewer CPUs or threads instead (--cpus, --threads)")
        netem = sx.netem_available()
        if cfg.shaper == "netem" and not netem:
            raise DgrError("--shaper netem: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)",
                           hint="use --shaper proxy (the userspace link proxy) or auto")
        delay_wanted = bool(cfg.rtt_ms or cfg.jitter_ms or cfg.loss)
        mech = "none" if not delay_wanted else ("netem" if (netem and cfg.shaper != "proxy") else "proxy")
        st["shaping"] = {"rate_mbit": cfg.rate_mbit, "rate_mechanism": "tbf" if cfg.rate_mbit else "none",
                         "rtt_ms": cfg.rtt_ms, "jitter_ms": cfg.jitter_ms, "loss": cfg.loss,
                         "delay_mechanism": mech, "netem_available": netem,
                         "proxy_loss_model": "a lost chunk is delivered one RTO (200 ms) late, in order"
                         if mech == "proxy" and cfg.loss else None,
                         "proxy_placement": "one proxy per exposed service, in the destination host's namespace, "
                                            "not confined to its CPU set" if mech == "proxy" else None}
        st["cgroup_mode"] = mode
        st["allowed_cpus"] = allowed
        self._save()
        bridge = f"{sx.LINK_PREFIX}{cfg.name}br"
        _log.info(f"lab {cfg.name}: bridge {bridge} {st['gateway']}/{net.prefixlen}, {cfg.hosts} host(s), "
            f"cgroups {mode}, delay by {mech}" + (f", rate {cfg.rate_mbit} Mbit/s (tbf)" if cfg.rate_mbit else ""))
        sx.run(["ip", "link", "add", bridge, "type", "bridge"])
        self._created("link", bridge)
        st["bridge"] = bridge
        sx.run(["ip", "addr", "add", f"{st['gateway']}/{net.prefixlen}", "dev", bridge])
        sx.run(["ip", "link", "set", bridge, "up"])
        used: dict[str, str] = {}
        for i in range(1, cfg.hosts + 1):
            name = f"h{i}"
            ns = f"{sx.NETNS_PREFIX}{cfg.name}-{name}"
            veth = f"{sx.LINK_PREFIX}{cfg.name}{name}"
            ip = str(hosts_ip[i])
            if cfg.cpus:
                cpus = cfg.cpus[i - 1]   # checked against `allowed` in up() (_check_cpus)
            else:
                k = cfg.cores_per_host
                cpus = ",".join(str(allowed[((i - 1) * k + j) % len(allowed)]) for j in range(k))
            threads = cfg.host_threads(i - 1, cpus)
            memory_mb = cfg.host_memory_mb(i - 1)
            quota = cfg.host_cpu_quota(i - 1)
            if quota is not None and quota > len(parse_cpus(cpus)):
                raise DgrError(f"--cpu-quota {quota:g} cores for {name}, which has {len(parse_cpus(cpus))} CPU(s) "
                               f"({cpus}): a quota caps CPU time within the host's CPUs")
            sx.run(["ip", "netns", "add", ns])
            self._created("netns", ns)
            sx.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"])
            self._created("link", veth)
            sx.run(["ip", "link", "set", f"{veth}p", "netns", ns])
            sx.run(["ip", "-n", ns, "link", "set", f"{veth}p", "name", "eth0"])
            sx.run(["ip", "link", "set", veth, "master", bridge])
            sx.run(["ip", "link", "set", veth, "up"])
            sx.run(["ip", "-n", ns, "addr", "add", f"{ip}/{net.prefixlen}", "dev", "eth0"])
            sx.run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            sx.run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._shape(ns, veth, cfg, mech)
            cg_name = f"{sx.CGROUP_PREFIX}{cfg.name}-{name}"
            cgs = sx.make_cgroups(cg_name, cpus, memory_mb, mode, cpu_quota=quota)
            for cg in cgs:
                self._created("cgroup", cg)
            shares = [other for other, c in used.items() if set(parse_cpus(c)) & set(parse_cpus(cpus))]
            used[name] = cpus
            h = Host(name, ns, veth, ip, cpus, threads, memory_mb, cgs, shares, cpu_quota=quota)
            st["hosts"].append(asdict(h))
            self._save()
            _log.info(f"  {name}: netns {ns}, {ip}, CPUs {cpus}{' (shared with ' + ','.join(shares) + ')' if shares else ''}, "
                f"{threads} thread(s)" + (f", memory {memory_mb} MiB" if memory_mb else "")
                + (f", CPU time {quota:g} core(s)" if quota is not None else ""))
        from ..pki import make_pki

        pki = make_pki(self.dir / "pki", {h["name"]: [h["ip"]] for h in st["hosts"]},
                       common_name=f"dgr lab {self.name} CA (throwaway)")
        st["pki"] = pki.to_json()
        self._save()
        _log.info(f"  mTLS: the lab's CA {pki.ca} (per-host certs, SAN = host IP; driver cert client.pem)")

    def _pick_subnet(self, cfg: LabConfig) -> ipaddress.IPv4Network:
        taken = [ipaddress.ip_interface(a).network for a in sx.root_addresses()]
        if cfg.subnet:
            net = ipaddress.ip_network(cfg.subnet)   # its form was checked by LabConfig.validate
            if any(net.overlaps(t) for t in taken):
                raise DgrError(f"--subnet {net} is already in use on this machine")
            return net
        start = zlib.crc32(cfg.name.encode()) % 500
        for k in range(500):
            x = (start + k) % 500 + 2          # 198.18.2.0/24 .. 198.19.245.0/24
            net = ipaddress.ip_network(f"198.{18 + x // 256}.{x % 256}.0/24")
            if not any(net.overlaps(t) for t in taken):
                return net
        raise DgrError("no free /24 left in 198.18.0.0/15 on this machine")

    def _shape(self, ns: str, veth: str, cfg: LabConfig, mech: str) -> None:
        rate = cfg.rate_mbit
        if mech == "netem":
            # netem on each host's egress: host -> host crosses one egress each way (RTT = rtt_ms)
            args = ["delay", f"{cfg.rtt_ms / 2}ms"] + ([f"{cfg.jitter_ms / 2}ms"] if cfg.jitter_ms else []) \
                + (["loss", f"{cfg.loss * 100}%"] if cfg.loss else []) + (["rate", f"{rate}mbit"] if rate else [])
            sx.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", *args])
            if rate:
                sx.run(["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", f"{rate}mbit", "burst",
                        str(max(32768, int(rate * 1e6 / 8 / 250))), "latency", "50ms"])
            return
        if rate:
            burst = str(max(32768, int(rate * 1e6 / 8 / 250)))
            for pre in ([], ["ip", "netns", "exec", ns]):
                dev = veth if not pre else "eth0"
                sx.run([*pre, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}mbit",
                        "burst", burst, "latency", "50ms"])

    # ---- processes in a host --------------------------------------------------------------

    def prefix(self, host: Host | str) -> list[str]:
        """argv prefix that runs a command inside the host: its cgroups, its namespace, its CPUs."""
        h = self.host(host) if isinstance(host, str) else host
        joins = " && ".join(f"echo $$ > {shlex.quote(sx.tasks_file(cg))}" for cg in h.cgroups)
        script = (joins + " && " if joins else "") + 'exec "$@"'
        return ["sh", "-c", script, "sh", "ip", "netns", "exec", h.netns, "taskset", "-c", h.cpus]

    def wrapper(self, host: Host | str, exe: Path) -> Path:
        """An executable script that runs ``exe`` inside the host (for supervisors that take a
        binary path, e.g. the worker supervisor)."""
        h = self.host(host) if isinstance(host, str) else host
        d = self.dir / h.name / "bin"
        d.mkdir(parents=True, exist_ok=True)
        out = d / exe.name
        lines = ["#!/bin/sh", f"# dgr lab {self.name}: run {exe.name} inside simulated host {h.name}"]
        lines += [f"echo $$ > {shlex.quote(sx.tasks_file(cg))} || exit 97" for cg in h.cgroups]
        lines.append(f"exec ip netns exec {shlex.quote(h.netns)} taskset -c {h.cpus} {shlex.quote(str(exe))} \"$@\"")
        out.write_text("\n".join(lines) + "\n")
        out.chmod(0o755)
        return out

    def spawn(self, host: Host | str, argv: Sequence[str], *, log_name: str | None = None,
              env: dict[str, str] | None = None, stdout: Any = None) -> subprocess.Popen:
        """Starts ``argv`` inside the host (background); its output goes to
        <lab dir>/<host>/<log_name>.log unless ``stdout`` is given."""
        h = self.host(host) if isinstance(host, str) else host
        d = self.dir / h.name
        d.mkdir(parents=True, exist_ok=True)
        out = stdout
        if out is None:
            out = open(d / f"{log_name or Path(argv[0]).name}.log", "ab")
        try:
            p = childproc.popen([*self.prefix(h), *argv], stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT if stdout is None else subprocess.PIPE,
                                 env={**os.environ, **(env or {})})
        finally:
            if stdout is None:
                out.close()     # the child holds its own copy
        self.record(h, p.pid, argv)
        return p

    def record(self, host: Host, pid: int, argv: Sequence[str]) -> None:
        """Notes a process started for `host` (with its start time, so that `down` stops it even
        before it has joined the host's namespace and cgroups, and never stops a reused pid)."""
        self.state["processes"].append({"host": host.name, "pid": pid, "start": sx.start_ticks(pid),
                                        "argv": list(argv)})
        self._save()

    def exec(self, host: str, argv: Sequence[str], *, timeout: float | None = None) -> int:
        """Runs ``argv`` inside the host in the foreground; returns its exit code."""
        if not argv:
            raise DgrError("nothing to run: give a command after --")
        try:
            return subprocess.run([*self.prefix(host), *argv], timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise DgrError(f"`{shlex.join(argv)}` in {host} did not finish within {timeout}s") from None

    def run(self, host: str | Host, argv: Sequence[str], *, timeout: float = 1800.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Runs ``argv`` inside the host, output captured (text); bounded by ``timeout``."""
        try:
            return subprocess.run([*self.prefix(host), *argv], capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            raise DgrError(f"`{shlex.join(argv)}` did not finish within {timeout:.0f}s") from None

    def expose(self, host: Host | str, port: int) -> str:
        """The endpoint other hosts (and the driver) use to reach ``host``'s service on ``port``:
        the service itself, or (delay/jitter/loss by the proxy) a link proxy in the host's
        namespace forwarding to it."""
        h = self.host(host) if isinstance(host, str) else host
        sh = self.shaping
        if sh["delay_mechanism"] != "proxy":
            return f"{h.ip}:{port}"
        stats = self.dir / h.name / f"proxy-{port}.json"
        stats.parent.mkdir(parents=True, exist_ok=True)
        argv = ["ip", "netns", "exec", h.netns, sys.executable, "-m", "dgr.lab.proxy",
                "--map", f"{h.ip}:0={h.ip}:{port}", "--delay-ms", str(sh["rtt_ms"] / 2),
                "--jitter-ms", str(sh["jitter_ms"] / 2), "--loss", str(sh["loss"]), "--stats", str(stats),
                "--control", str(stats.with_suffix(".control.json"))]
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.state["proxies"].append({"host": h.name, "pid": p.pid, "target": f"{h.ip}:{port}", "stats": str(stats),
                                      "control": str(stats.with_suffix(".control.json"))})
        self._save()
        line = sx.readline(p, 15.0)
        m = re.search(r"ready (\S+)", line or "")
        if not m:
            sx.stop_pids([p.pid])
            err = p.stderr.read().decode(errors="replace")[-300:] if p.stderr else ""
            raise DgrError(f"link proxy for {h.name}:{port} did not start: {line or ''} {err}".strip())
        ep = m.group(1)
        self.state["proxies"][-1]["listen"] = ep
        self._save()
        return ep

    def unexpose(self, targets: set[str]) -> int:
        """Stops the link proxies this lab started in front of ``targets`` (``ip:port`` of the
        services) and forgets them; returns how many."""
        gone = [pr for pr in self.state["proxies"] if pr["target"] in targets]
        sx.stop_pids([pr["pid"] for pr in gone if sx.alive(pr["pid"]) and "dgr.lab.proxy" in sx.cmdline(pr["pid"])])
        self.state["proxies"] = [pr for pr in self.state["proxies"] if pr not in gone]
        self._save()
        return len(gone)

    def proxy_stats(self) -> list[dict[str, Any]]:
        out = []
        for pr in self.state["proxies"]:
            try:
                out.append({"host": pr["host"], "listen": pr.get("listen"), "target": pr["target"],
                            **json.loads(Path(pr["stats"]).read_text())})
            except (OSError, ValueError):
                out.append({"host": pr["host"], "listen": pr.get("listen"), "target": pr["target"]})
        return out

    def blackhole(self, host: str, on: bool) -> int:
        """Stops (or resumes) delivery through every link proxy into ``host``; returns how many."""
        n = 0
        for pr in self.state["proxies"]:
            if pr["host"] == host and sx.alive(pr["pid"]) and "dgr.lab.proxy" in sx.cmdline(pr["pid"]):
                os.kill(pr["pid"], signal.SIGUSR1 if on else signal.SIGUSR2)
                n += 1
        return n

    def host_pids(self, host: Host) -> list[int]:
        pids = set(sx.netns_pids(host.netns))
        for cg in host.cgroups:
            pids |= set(sx.cgroup_pids(cg))
        return sorted(p for p in pids if sx.alive(p))

    # ---- down -----------------------------------------------------------------------------

    def down(self) -> dict[str, Any]:
        """Removes everything this lab created (processes, namespaces, links, cgroups, files),
        in reverse order; idempotent. Returns what was removed and anything that could not be."""
        removed: dict[str, list] = {"processes": [], "netns": [], "links": [], "cgroups": [], "dirs": []}
        left: list[str] = []
        pids: set[int] = set()
        for h in self.hosts:
            pids |= set(self.host_pids(h))
        for pr in self.state.get("proxies", []):
            if sx.alive(pr["pid"]) and "dgr.lab.proxy" in sx.cmdline(pr["pid"]):
                pids.add(pr["pid"])
        # started by spawn() but maybe not yet in the host's namespace or cgroups (a signal right
        # after the start): found by their recorded pid and start time
        pids |= {pid for pr in self.state.get("processes", []) if (pid := sx.recorded(pr)) is not None}
        for kind, val in self.state.get("created", []):
            if kind == "netns" and val in sx.netns_list():
                pids |= set(sx.netns_pids(val))
            elif kind == "cgroup":
                pids |= set(sx.cgroup_pids(val))
        if pids:
            sx.stop_pids(sorted(pids))
            removed["processes"] = sorted(pids)
        for kind, val in reversed(self.state.get("created", [])):
            if kind == "netns":
                if val in sx.netns_list():
                    sx.run(["ip", "netns", "del", val], check=False)
                if val in sx.netns_list():
                    left.append(f"netns {val}")
                else:
                    removed["netns"].append(val)
            elif kind == "link":
                if sx.link_exists(val):
                    sx.run(["ip", "link", "del", val], check=False)
                if sx.link_exists(val):
                    left.append(f"link {val}")
                else:
                    removed["links"].append(val)
            elif kind == "cgroup":
                if sx.remove_cgroup(val):
                    removed["cgroups"].append(val)
                else:
                    left.append(f"cgroup {val}")
            elif kind == "dir":
                shutil.rmtree(val, ignore_errors=True)
                removed["dirs"].append(val)
        if left:
            _log.warning("could not remove: " + ", ".join(left))
        else:
            self.path.unlink(missing_ok=True)
        _log.info(f"lab {self.name} down: {len(removed['processes'])} process(es), {len(removed['netns'])} namespace(s), "
            f"{len(removed['links'])} link(s), {len(removed['cgroups'])} cgroup(s) removed")
        return {"removed": removed, "left": left}

    # ---- context manager: always torn down ------------------------------------------------

    def _trap(self) -> sx.SignalTrap:
        return sx.SignalTrap()

    def __enter__(self) -> "Lab":
        self._ctx_trap = self._trap()
        self._ctx_trap.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        finally:
            self._ctx_trap.__exit__(*exc)

    def status(self) -> dict[str, Any]:
        """The lab as recorded, with what actually exists now."""
        ns = set(sx.netns_list())
        hosts = []
        for h in self.hosts:
            procs = [{"pid": p, "cmd": sx.cmdline(p)[:160]} for p in self.host_pids(h)] if h.netns in ns else []
            hosts.append({**asdict(h), "netns_present": h.netns in ns, "veth_present": sx.link_exists(h.veth),
                          "processes": procs})
        return {"name": self.name, "subnet": self.state.get("subnet"), "gateway": self.state.get("gateway"),
                "bridge": self.state.get("bridge"), "bridge_present": sx.link_exists(self.state.get("bridge", "-")),
                "cgroup_mode": self.state.get("cgroup_mode"), "shaping": self.state.get("shaping"),
                "hosts": hosts, "proxies": self.proxy_stats(), "pki": self.state.get("pki", {}).get("dir"),
                "state_file": str(self.path)}
