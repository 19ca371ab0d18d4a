"""Lab objects no state file accounts for (``dgr lab status`` lists them, ``dgr lab down
--strays`` removes them): namespaces, links and cgroups with the lab's name prefixes, left by a
state file that was lost. Only prefixed names are ever considered."""

from __future__ import annotations

from ..errors import DgrError
from . import system as sx
from .hosts import Lab


def stray_objects() -> dict[str, list[str]]:
    """Objects with the lab's name prefixes that no state file accounts for (after a state file
    was lost): namespaces, links, cgroups."""
    known_ns, known_links, known_cg = set(), set(), set()
    for n in Lab.names():
        try:
            lab = Lab.load(n)
        except (DgrError, ValueError):
            continue
        for kind, val in lab.state.get("created", []):
            {"netns": known_ns, "link": known_links, "cgroup": known_cg}.get(kind, set()).add(val)
    ns = [n for n in sx.netns_list() if n.startswith(sx.NETNS_PREFIX) and n not in known_ns]
    links = [n for n in sx.links_with_prefix() if n not in known_links and not n.endswith("p")]
    cgs = []
    for root in (sx.CGROUP_ROOT / "cpuset", sx.CGROUP_ROOT / "memory", sx.CGROUP_ROOT / "cpu", sx.CGROUP_ROOT):
        if root.is_dir():
            cgs += [str(p) for p in root.glob(f"{sx.CGROUP_PREFIX}*") if p.is_dir() and str(p) not in known_cg]
    return {"netns": ns, "links": links, "cgroups": cgs}


def remove_strays(strays: dict[str, list[str]]) -> list[str]:
    """Removes prefixed objects no lab accounts for (``dgr lab down --strays``); returns what is left."""
    left = []
    for ns in strays["netns"]:
        sx.stop_pids(sx.netns_pids(ns))
        sx.run(["ip", "netns", "del", ns], check=False)
        if ns in sx.netns_list():
            left.append(ns)
    for ln in strays["links"]:
        sx.run(["ip", "link", "del", ln], check=False)
        if sx.link_exists(ln):
            left.append(ln)
    for cg in strays["cgroups"]:
        sx.stop_pids(sx.cgroup_pids(cg))
        if not sx.remove_cgroup(cg):
            left.append(cg)
    return left
