"""Model Artifact identity: the canonical manifest of a GGUF and its artifact id (docs/identity.md).

The manifest lists the metadata digest and, per tensor, name, ggml type, shape, byte count and
sha256 of the bytes; the artifact id is the sha256 of its canonical text (docs/identity.md).
Because every tensor has its own entry, a node holding only a slice verifies its tensors
against the manifest that the slice carries, and the manifest against the artifact id.

A split GGUF set (``PREFIX-NNNNN-of-MMMMM.gguf``, :mod:`dgr.gguf.gguf_set`) is one artifact: its
manifest lists the tensors of every part, its metadata digest is part 1's, so its artifact id
is that of the same model as one file.

Hashing a large file takes a while, so results are cached by (path, size, mtime_ns) — of every
part, for a set — in ``$DGR_CACHE_DIR/identity`` (default ``build/cache/identity``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import DgrError
from .gguf_set import GgufModel, GgufSet, open_model, split_name
from .inspect import GgufFile
from ..console import Progress

MANIFEST_HEADER = "dgr-artifact-manifest/v1"
# v2: the metadata digest excludes split.* pairs; keys list every part of a split set
CACHE_FORMAT = "dgr-identity-cache/v2"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 16 << 20


class ManifestError(DgrError):
    """A manifest text that is not in canonical form."""


def encode_name(name: str) -> str:
    """Tensor names in manifest lines: bytes outside '!'..'~' and '%' itself become %XX."""
    out = []
    for b in name.encode("utf-8"):
        out.append(chr(b) if 0x21 <= b <= 0x7E and b != 0x25 else f"%{b:02X}")
    return "".join(out)


def decode_name(text: str) -> str:
    raw = bytearray()
    i = 0
    while i < len(text):
        if text[i] == "%":
            raw.append(int(text[i + 1:i + 3], 16))
            i += 3
        else:
            raw.append(ord(text[i]))
            i += 1
    return raw.decode("utf-8")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's manifest entry."""
    name: str
    ggml_type: int
    shape: tuple[int, ...]   # GGUF order (ne0 first)
    n_bytes: int
    sha256: str

    def line(self) -> str:
        shape = "x".join(str(d) for d in self.shape)
        return f"tensor {encode_name(self.name)} {self.ggml_type} {shape} {self.n_bytes} {self.sha256}"

    @classmethod
    def parse(cls, line: str) -> "TensorEntry":
        parts = line.split(" ")
        try:
            if len(parts) != 6 or parts[0] != "tensor":
                raise ValueError("expected 'tensor NAME TYPE SHAPE NBYTES SHA256'")
            _, name, typ, shape, nbytes, digest = parts
            if not _HEX64.match(digest):
                raise ValueError("sha256 must be 64 lowercase hex digits")
            entry = cls(decode_name(name), int(typ), tuple(int(d) for d in shape.split("x")), int(nbytes), digest)
        except ValueError as exc:
            raise ManifestError(f"bad manifest line {line[:120]!r}: {exc}") from None
        if entry.line() != line:
            raise ManifestError(f"manifest line is not canonical: {line[:120]!r}")
        return entry

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ggml_type": self.ggml_type, "shape": list(self.shape),
                "n_bytes": self.n_bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    metadata_digest: str
    tensors: tuple[TensorEntry, ...]   # sorted by name (UTF-8 bytes)

    def text(self) -> str:
        lines = [MANIFEST_HEADER, f"metadata {self.metadata_digest}", f"tensors {len(self.tensors)}"]
        lines += [t.line() for t in self.tensors]
        return "\n".join(lines) + "\n"

    @property
    def artifact_id(self) -> str:
        return hashlib.sha256(self.text().encode("utf-8")).hexdigest()

    def entry(self, name: str) -> TensorEntry | None:
        return self.by_name().get(name)

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @classmethod
    def build(cls, metadata_digest: str, entries: list[TensorEntry]) -> "Manifest":
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ManifestError("duplicate tensor names in manifest")
        return cls(metadata_digest, tuple(sorted(entries, key=lambda e: e.name.encode("utf-8"))))

    @classmethod
    def parse(cls, text: str) -> "Manifest":
        if not text.endswith("\n"):
            raise ManifestError("manifest text must end with a newline")
        lines = text[:-1].split("\n")
        if len(lines) < 3 or lines[0] != MANIFEST_HEADER:
            raise ManifestError(f"not a {MANIFEST_HEADER} manifest")
        if not lines[1].startswith("metadata ") or not _HEX64.match(lines[1][9:]):
            raise ManifestError("manifest line 2 must be 'metadata <sha256>'")
        try:
            count = int(lines[2].split(" ", 1)[1]) if lines[2].startswith("tensors ") else -1
        except ValueError:
            count = -1
        if count != len(lines) - 3:
            raise ManifestError("manifest tensor count does not match its lines")
        m = cls.build(lines[1][9:], [TensorEntry.parse(line) for line in lines[3:]])
        if m.text() != text:
            raise ManifestError("manifest is not in canonical order")
        return m


@dataclass(frozen=True)
class ArtifactIdentity:
    """What `dgr gguf fingerprint` reports for one file or split set (``path``: part 1's,
    ``size``: all parts together, ``parts``: every part's path, empty for a single file)."""
    path: str
    size: int
    architecture: str
    tokenizer_digest: str
    manifest: Manifest
    parts: tuple[str, ...] = ()

    @property
    def artifact_id(self) -> str:
        return self.manifest.artifact_id

    @property
    def metadata_digest(self) -> str:
        return self.manifest.metadata_digest

    def to_json(self, *, entries: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "path": self.path, "size": self.size, "artifact_id": self.artifact_id,
            "metadata_digest": self.metadata_digest, "tokenizer_digest": self.tokenizer_digest,
            "architecture": self.architecture, "n_tensors": len(self.manifest.tensors),
            "tensor_bytes": self.manifest.total_bytes, "manifest_format": MANIFEST_HEADER,
        }
        if self.parts:
            d["parts"] = list(self.parts)
        if entries:
            d["tensors"] = [t.to_json() for t in self.manifest.tensors]
        return d


def hash_tensors(gf: GgufFile | GgufSet, names: list[str] | None = None, *, progress: bool = True,
                 label: str = "hashing") -> list[TensorEntry]:
    """Manifest entries for the named tensors (all by default), hashing their exact bytes."""
    infos = [gf.tensor(n) for n in names] if names is not None else list(gf.tensors)
    total = sum(t.n_bytes for t in infos)
    entries = []
    bar = Progress(f"{label} {gf.path.name}", total) if progress else None
    try:
        for t in infos:
            data = gf.tensor_bytes(t.name)
            h = hashlib.sha256()
            for start in range(0, t.n_bytes, _CHUNK):
                n = min(_CHUNK, t.n_bytes - start)
                h.update(data[start:start + n])
                if bar:
                    bar.update(n)
            del data
            entries.append(TensorEntry(t.name, t.ggml_type, t.shape, t.n_bytes, h.hexdigest()))
    finally:
        if bar:
            bar.close()
    return entries


def manifest_of(gf: GgufModel, *, progress: bool = True) -> Manifest:
    return Manifest.build(gf.metadata_digest(), hash_tensors(gf, progress=progress))


# ---- cache ----

def cache_dir() -> Path | None:
    env = os.environ.get("DGR_CACHE_DIR")
    if env:
        return Path(env).resolve() / "identity"
    try:
        return paths.build_dir() / "cache" / "identity"
    except DgrError:
        return None


CacheKey = list[Any]


def _file_key(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _cache_key(paths: list[Path]) -> CacheKey:
    """(resolved path, size, mtime_ns) of a file; for a split set, of every part in order."""
    if len(paths) == 1:
        return _file_key(paths[0])
    return ["split-set"] + [_file_key(p) for p in paths]


def _cache_file(key: CacheKey) -> Path | None:
    d = cache_dir()
    if d is None:
        return None
    h = hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()[:32]
    return d / f"{h}.json"


def _cache_load(key: CacheKey, path: str, size: int, parts: tuple[str, ...]) -> ArtifactIdentity | None:
    f = _cache_file(key)
    if f is None or not f.is_file():
        return None
    try:
        d = json.loads(f.read_text())
        if d.get("format") != CACHE_FORMAT or d["key"] != key:
            return None
        m = Manifest.parse(d["manifest"])
        if m.artifact_id != d["artifact_id"]:
            return None
        return ArtifactIdentity(path, size, d["architecture"], d["tokenizer_digest"], m, parts)
    except (ValueError, KeyError, TypeError, DgrError):
        return None  # a damaged cache entry is recomputed, never trusted


def _cache_store(key: CacheKey, ident: ArtifactIdentity) -> None:
    f = _cache_file(key)
    if f is None:
        return
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({
            "format": CACHE_FORMAT, "key": key, "artifact_id": ident.artifact_id,
            "architecture": ident.architecture, "tokenizer_digest": ident.tokenizer_digest,
            "manifest": ident.manifest.text()}))
        tmp.replace(f)
    except OSError:
        pass  # the cache is an optimisation only


def clear_cache() -> int:
    d = cache_dir()
    n = 0
    if d and d.is_dir():
        for f in d.glob("*.json"):
            f.unlink(missing_ok=True)
            n += 1
    return n


def identify(path: str | Path, *, progress: bool = True, use_cache: bool = True) -> ArtifactIdentity:
    """The artifact identity of a GGUF file, or of the whole split set ``path`` is a part of
    (manifest + artifact id), cached by (path, size, mtime_ns) of every file it covers.

    A set is checked (every part's header; docs/identity.md "Split GGUF sets") on every call,
    also when the identity comes from the cache: a broken set is a DgrError naming the part."""
    p = Path(path)
    if not p.is_file():
        raise DgrError(f"GGUF file not found: {p}")
    if split_name(p.name) is None:
        key = _cache_key([p])
        if use_cache:
            hit = _cache_load(key, key[0], key[1], ())
            if hit is not None:
                return hit
        with open_model(p) as gf:   # refuses a renamed split part
            return _identify_open(gf, key, progress=progress, use_cache=use_cache)
    with open_model(p) as m:
        paths_ = [m.path] if isinstance(m, GgufFile) else m.part_paths
        key = _cache_key(paths_)
        parts = tuple(str(q.resolve()) for q in paths_) if isinstance(m, GgufSet) else ()
        if use_cache:
            hit = _cache_load(key, str(m.path.resolve()), sum(q.stat().st_size for q in paths_), parts)
            if hit is not None:
                return hit
        return _identify_open(m, key, progress=progress, use_cache=use_cache)


def _identify_open(m: GgufModel, key: CacheKey, *, progress: bool, use_cache: bool) -> ArtifactIdentity:
    paths_ = m.part_paths if isinstance(m, GgufSet) else [m.path]
    arch = m.get("general.architecture")
    ident = ArtifactIdentity(str(m.path.resolve()), m.size, arch if isinstance(arch, str) else "",
                             m.tokenizer_digest(), manifest_of(m, progress=progress),
                             tuple(str(q.resolve()) for q in paths_) if isinstance(m, GgufSet) else ())
    if use_cache and _cache_key(paths_) == key:  # unchanged while we hashed it
        _cache_store(key, ident)
    return ident


def weight_types_digest(manifest: Manifest) -> str:
    """sha256 over 'name type' lines of every tensor: the weight quantization in one value."""
    text = "".join(f"{encode_name(t.name)} {t.ggml_type}\n" for t in manifest.tensors)
    return hashlib.sha256(b"dgr-weight-types/v1\n" + text.encode()).hexdigest()


def weight_types_summary(manifest: Manifest) -> dict[str, int]:
    import gguf

    counts: dict[str, int] = {}
    for t in manifest.tensors:
        name = gguf.GGMLQuantizationType(t.ggml_type).name
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))
