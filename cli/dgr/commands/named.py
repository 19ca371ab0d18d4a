"""Repeated ``--flag NAME=VALUE`` options (``dgr pki issue --host``, ``dgr plan --worker``)."""

from __future__ import annotations

from typing import Sequence

from ..errors import DgrError


def named_values(items: Sequence[str], flag: str, shape: str) -> list[tuple[str, str]]:
    """``NAME=VALUE`` each -> [(name, value)] in order; DgrError naming ``flag`` and the expected
    ``shape`` on a malformed item, or naming a repeated NAME."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise DgrError(f"{flag} {item!r}: expected {shape}")
        if name in seen:
            raise DgrError(f"{flag} {name} is given twice")
        seen.add(name)
        out.append((name, value))
    return out
