"""Simulated hosts on one machine (``dgr lab``): network namespaces on a bridge, each with its
own CPU set, threads and memory budget, shaped links (tc tbf; netem or a userspace link proxy
for delay, jitter, loss, blackhole), a throwaway CA for mutual TLS, and routes whose workers
run in those hosts and talk over real TCP.

- :mod:`dgr.lab.hosts`   ``Lab``: up / down / status / exec / spawn, the state file
- :mod:`dgr.lab.system`  ip / tc / cgroup / process operations (prefixed names only)
- :mod:`dgr.lab.proxy`   the userspace link (``python -m dgr.lab.proxy``)
- :mod:`dgr.pki`         the CA every lab issues its certificates with (``dgr pki issue`` on real machines)
- :mod:`dgr.lab.route`   workers of a route placed on lab hosts, with mTLS on every hop
"""
