"""Evidence figures for the outreach texts: read a value from ``evidence/*/results.json``.

``figures.toml`` (in ``upstream/outreach/templates/``) lists every figure the texts may print:
an id, a label, the evidence file, an RFC 6901 JSON pointer into it and a format. A figure that
cannot be read (missing file or key, wrong type) is an error naming the figure, so a text never
prints a stale or guessed number.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import paths
from ..errors import DgrError

def resolve_pointer(doc: Any, pointer: str) -> Any:
    """RFC 6901 JSON pointer (``/metrics/full_gguf/0:15/rss_bytes``)."""
    if pointer == "":
        return doc
    if not pointer.startswith("/"):
        raise KeyError(pointer)
    cur = doc
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(cur, list):
            if not token.isdigit() or int(token) >= len(cur):
                raise KeyError(pointer)
            cur = cur[int(token)]
        elif isinstance(cur, dict) and token in cur:
            cur = cur[token]
        else:
            raise KeyError(pointer)
    return cur


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError("a number")
    return float(v)


def _bool(v: Any) -> str:
    if not isinstance(v, bool):
        raise TypeError("true or false")
    return "true" if v else "false"


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError("text")
    return v


FORMATS: dict[str, Callable[[Any], str]] = {
    "mib": lambda v: f"{_num(v) / 2**20:.1f} MiB",
    "bytes": lambda v: f"{int(_num(v))} bytes",
    "int": lambda v: f"{int(_num(v))}",
    "ratio": lambda v: f"{_num(v):.3f}",
    "float": lambda v: f"{_num(v):.4g}",
    "tok_s": lambda v: f"{_num(v):.1f} tok/s",
    "ms": lambda v: f"{_num(v) * 1000:.1f} ms",
    "bool": _bool,
    "ranges": lambda v: ", ".join(f"{int(_num(a))}:{int(_num(b))}" for a, b in v),
    "text": _text,
    "basename": lambda v: Path(_text(v)).name,
}


@dataclass(frozen=True)
class Figure:
    id: str
    label: str
    text: str        # the formatted value
    file: str        # repository-relative evidence file
    pointer: str     # RFC 6901 pointer into it

    @property
    def source(self) -> str:
        return f"{self.file}#{self.pointer}"


def load_figures(manifest: Path | None = None, root: Path | None = None) -> dict[str, Figure]:
    root = root or paths.repo_root()
    manifest = manifest or paths.repo_root() / "upstream" / "outreach" / "templates" / "figures.toml"
    try:
        entries = tomllib.loads(manifest.read_text())["figure"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as exc:
        raise DgrError(f"cannot read the figure list {manifest}: {exc}") from None
    docs: dict[str, Any] = {}
    figures: dict[str, Figure] = {}
    for e in entries:
        fid, file, pointer, fmt = e.get("id"), e.get("file"), e.get("pointer"), e.get("format")
        if not all(isinstance(x, str) for x in (fid, file, pointer, fmt)) or fmt not in FORMATS:
            raise DgrError(f"{manifest.name}: figure {fid!r} needs id, file, pointer and format ({', '.join(FORMATS)})")
        if fid in figures:
            raise DgrError(f"{manifest.name}: figure {fid!r} is listed twice")
        if file not in docs:
            path = root / file
            try:
                docs[file] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise DgrError(f"figure {fid}: cannot read {file}: {exc}",
                               hint="evidence folders are written by `dgr accept`") from None
        try:
            value = resolve_pointer(docs[file], pointer)
            text = FORMATS[fmt](value)
        except KeyError:
            raise DgrError(f"figure {fid}: {file} has no value at {pointer}",
                           hint=f"fix the pointer in {manifest.name} or re-run the story that writes {file}") from None
        except (TypeError, ValueError) as exc:
            raise DgrError(f"figure {fid}: {file}#{pointer} is {value!r}, format {fmt} needs {exc}") from None
        figures[fid] = Figure(fid, e.get("label", fid), text, file, pointer)
    return figures
