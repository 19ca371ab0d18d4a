"""Addresses parsed, never compared as strings (the Python side of worker/src/common/net_address.h).

A host is an IP literal (IPv4, IPv6, IPv4-mapped IPv6, with or without ``[brackets]``), parsed by
:mod:`ipaddress`; anything else is a name, resolved once with :func:`socket.getaddrinfo`, and
EVERY address it resolves to is checked. ``127.0.0.1.evil.example`` or ``localhost.attacker``
are therefore whatever DNS says (refused when they do not resolve), never loopback because of
how they start.
"""

from __future__ import annotations

import ipaddress
import socket

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_ip(host: str) -> IpAddress | None:
    """An IP literal, IPv4-mapped IPv6 folded to its IPv4 address; None for anything else."""
    h = host[1:-1] if len(host) >= 2 and host[0] == "[" and host[-1] == "]" else host
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def resolve(host: str) -> list[IpAddress]:
    """The addresses ``host`` stands for (a literal is itself); empty when it does not resolve."""
    ip = parse_ip(host)
    if ip is not None:
        return [ip]
    if not host:
        return []
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out: list[IpAddress] = []
    for info in infos:
        addr = parse_ip(str(info[4][0]).split("%", 1)[0])
        if addr is not None and addr not in out:
            out.append(addr)
    return out


def is_loopback_host(host: str) -> bool:
    """Every address ``host`` resolves to is loopback (127.0.0.0/8, ::1, mapped), and there is one."""
    addrs = resolve(host)
    return bool(addrs) and all(a.is_loopback for a in addrs)
