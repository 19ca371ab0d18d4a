"""Reading GGUF files safely: header, metadata (KV pairs), tensor table, summaries.

Everything that reads a GGUF in dgr goes through :func:`open_gguf`, a strict, bounds-checked
reader that turns a truncated or corrupt file into a :class:`DgrError` (never a traceback). It also gives the canonical byte form of each metadata pair, from which
:mod:`dgr.gguf.identity` computes the metadata and tokenizer digests (docs/identity.md).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..errors import DgrError

SLICE_PREFIX = "dgr.slice."
SPLIT_PREFIX = "split."   # split-set container pairs (dgr.gguf.gguf_set)
DIGEST_EXCLUDED = (SLICE_PREFIX, SPLIT_PREFIX)   # namespaces outside the metadata digest
METADATA_DOMAIN = b"dgr-gguf-metadata/v1\n"
TOKENIZER_DOMAIN = b"dgr-gguf-tokenizer/v1\n"
GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
INT64_MAX = 2**63 - 1  # ggml holds dimensions and element counts as int64
_BLK = re.compile(r"^blk\.(\d+)\.")

# GGUF metadata value types -> (struct format, size) for fixed-size scalars.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL = range(8)
T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = 8, 9, 10, 11, 12
_SCALAR = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
           T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d"}
_NP = {T_UINT8: "<u1", T_INT8: "<i1", T_UINT16: "<u2", T_INT16: "<i2", T_UINT32: "<u4", T_INT32: "<i4",
       T_FLOAT32: "<f4", T_BOOL: "?", T_UINT64: "<u8", T_INT64: "<i8", T_FLOAT64: "<f8"}


class GgufError(DgrError):
    """A file that is not a readable GGUF (missing, truncated, corrupt)."""


class _Corrupt(Exception):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int        # GGMLQuantizationType value
    type_name: str        # e.g. "Q4_1", for display only
    shape: tuple[int, ...]  # GGUF order: ne0 (fastest) first
    n_bytes: int
    offset: int           # absolute byte offset of the data in the file

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """numpy-order shape of the raw bytes (rows..., bytes per row), as GGUFWriter expects."""
        import gguf

        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        rows = tuple(reversed(self.shape[1:]))
        return rows + (self.shape[0] // block * type_size,)


@dataclass(frozen=True)
class _KV:
    vtype: int
    start: int    # offset of the value type u32
    end: int      # one past the value's last byte


def layer_of(tensor_name: str) -> int | None:
    """The block index of a ``blk.N.*`` tensor, else None."""
    m = _BLK.match(tensor_name)
    return int(m.group(1)) if m else None


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: Any, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(f"needs {n} bytes at offset {self.pos}, the file ends at {self.size}")

    def unpack(self, fmt: str, n: int) -> Any:
        self.need(n)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self) -> int:
        return self.unpack("<I", 4)

    def u64(self) -> int:
        return self.unpack("<Q", 8)

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"string at offset {self.pos - n} is not UTF-8") from None

    def skip_value(self, vtype: int, depth: int = 0) -> None:
        if vtype in _SCALAR:
            self.need(struct.calcsize(_SCALAR[vtype]))
            self.pos += struct.calcsize(_SCALAR[vtype])
        elif vtype == T_STRING:
            n = self.u64()
            self.need(n)
            self.pos += n
        elif vtype == T_ARRAY:
            if depth > 2:
                raise _Corrupt("metadata arrays nested too deeply")
            itype, count = self.u32(), self.u64()
            if itype in _SCALAR:
                self.need(count * struct.calcsize(_SCALAR[itype]))
                self.pos += count * struct.calcsize(_SCALAR[itype])
            elif itype == T_STRING:
                self.need(count * 8)
                unpack, buf, size = struct.unpack_from, self.buf, self.size
                pos = self.pos
                for _ in range(count):
                    if pos + 8 > size:
                        raise _Corrupt(f"string array runs past the end of the file at offset {pos}")
                    pos += 8 + unpack("<Q", buf, pos)[0]
                if pos > size:
                    raise _Corrupt("string array runs past the end of the file")
                self.pos = pos
            elif itype == T_ARRAY:
                for _ in range(count):
                    self.skip_value(T_ARRAY, depth + 1)
            else:
                raise _Corrupt(f"unknown array element type {itype}")
        else:
            raise _Corrupt(f"unknown metadata value type {vtype}")

    def read_value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            fmt = _SCALAR[vtype]
            return self.unpack(fmt, struct.calcsize(fmt))
        if vtype == T_STRING:
            return self.string()
        if vtype == T_ARRAY:
            itype, count = self.u32(), self.u64()
            if itype in _SCALAR:
                n = count * struct.calcsize(_SCALAR[itype])
                self.need(n)
                arr = np.frombuffer(self.buf, dtype=_NP[itype], count=count, offset=self.pos)
                self.pos += n
                return arr.tolist()
            return [self.read_value(itype) for _ in range(count)]
        raise _Corrupt(f"unknown metadata value type {vtype}")


def _element_count(name: str, dims: tuple[int, ...]) -> int:
    """The element count of a tensor's dimensions, refusing what ggml cannot hold: a zero
    dimension, a dimension that is negative as ggml's int64, a count that overflows int64."""
    n_el = 1
    for i, d in enumerate(dims):
        if d == 0:
            raise _Corrupt(f"tensor {name!r} has a zero dimension (ne{i} = 0, shape {list(dims)})")
        if d > INT64_MAX:
            raise _Corrupt(f"tensor {name!r} dimension ne{i} = {d} is negative as a signed 64-bit count")
        n_el *= d
        if n_el > INT64_MAX:
            raise _Corrupt(f"tensor {name!r}: the element count of shape {list(dims)} overflows 64 bits")
    return n_el


class GgufFile:
    """An opened, validated GGUF file (read through a private map; the ``gguf`` package's reader
    is not used for reading because it parses every vocabulary string into numpy objects —
    seconds per file — and turns reads past the end into short arrays instead of errors)."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        try:
            self._fh = open(path, "rb")
            self.size = os.fstat(self._fh.fileno()).st_size
            self._mm: Any = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            self.close()
            raise GgufError(f"cannot read {path}: {exc}") from None
        self._fields: dict[str, _KV] = {}
        cur = _Cursor(self._mm, self.size)
        try:
            cur.need(4)
            if bytes(self._mm[0:4]) != GGUF_MAGIC:
                raise _Corrupt("GGUF magic missing")
            cur.pos = 4
            self.version = cur.u32()
            if self.version not in SUPPORTED_VERSIONS:
                if self.version & 0xFFFF == 0:
                    raise _Corrupt("big-endian GGUF files are not supported")
                raise _Corrupt(f"GGUF version {self.version} is not supported (2 or 3)")
            n_tensors, n_kv = cur.u64(), cur.u64()
            if n_tensors > self.size // 24 or n_kv > self.size // 12:
                raise _Corrupt(f"the header declares {n_tensors} tensors and {n_kv} metadata pairs, "
                               f"more than a {self.size}-byte file can hold")
            for _ in range(n_kv):
                key = cur.string()
                vtype = cur.u32()
                start = cur.pos - 4
                cur.skip_value(vtype)
                if key in self._fields:
                    raise _Corrupt(f"duplicate metadata key {key!r}")
                self._fields[key] = _KV(vtype, start, cur.pos)
            raw = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.u32()
                if not 1 <= n_dims <= MAX_DIMS:
                    raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
                dims = tuple(cur.u64() for _ in range(n_dims))
                ttype, off = cur.u32(), cur.u64()
                raw.append((name, dims, ttype, off))
            self.alignment = DEFAULT_ALIGNMENT
            if "general.alignment" in self._fields:
                a = self.get("general.alignment")
                if self._fields["general.alignment"].vtype != T_UINT32 or a <= 0 or a & (a - 1):
                    raise _Corrupt("general.alignment must be a power-of-two u32")
                self.alignment = a
            self.data_offset = -(-cur.pos // self.alignment) * self.alignment
            tensors = []
            seen: set[str] = set()
            for name, dims, ttype, off in raw:
                if name in seen:
                    raise _Corrupt(f"duplicate tensor {name!r}")
                seen.add(name)
                try:
                    qtype = gguf.GGMLQuantizationType(ttype)
                    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                except (ValueError, KeyError):
                    raise _Corrupt(f"tensor {name!r} has unknown ggml type {ttype}") from None
                n_el = _element_count(name, dims)
                if dims[0] % block:
                    raise _Corrupt(f"tensor {name!r}: ne0 {dims[0]} is not a multiple of the block size {block}")
                n_bytes = n_el // block * type_size
                start = self.data_offset + off
                if off % self.alignment:
                    raise _Corrupt(f"tensor {name!r} data offset {off} is not aligned to {self.alignment}")
                if start + n_bytes > self.size:
                    raise _Corrupt(f"tensor {name!r} ends at byte {start + n_bytes}, the file has {self.size}")
                tensors.append(TensorInfo(name, ttype, qtype.name, dims, n_bytes, start))
        except _Corrupt as exc:
            self.close()
            raise GgufError(f"{path} is not a readable GGUF file, truncated or corrupt ({exc})",
                            hint="re-download or re-create it") from None
        self.little_endian = True
        self.tensors: list[TensorInfo] = tensors
        self._by_name = {t.name: t for t in tensors}

    # ---- metadata ----
    @property
    def keys(self) -> list[str]:
        return list(self._fields)

    def has(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        kv = self._fields.get(key)
        if kv is None:
            return default
        cur = _Cursor(self._mm, self.size)
        cur.pos = kv.start + 4
        try:
            return cur.read_value(kv.vtype)
        except _Corrupt as exc:
            raise GgufError(f"{self.path}: metadata {key!r} is corrupt ({exc})") from None

    def value_type(self, key: str) -> int:
        return self._fields[key].vtype

    def array_len(self, key: str) -> int | None:
        kv = self._fields.get(key)
        if kv is None or kv.vtype != T_ARRAY:
            return None
        return struct.unpack_from("<Q", self._mm, kv.start + 8)[0]

    def kv_value_offset(self, key: str) -> int:
        """File offset of one pair's value type (u32); the value follows it."""
        return self._fields[key].start

    def kv_value_bytes(self, key: str) -> bytes:
        """Canonical (little-endian GGUF v3) encoding of one pair's value: type u32, then the value."""
        kv = self._fields[key]
        return bytes(self._mm[kv.start:kv.end])

    def kv_bytes(self, key: str) -> bytes:
        """Canonical encoding of one pair: key (u64 length + UTF-8), value type, value."""
        k = key.encode("utf-8")
        return len(k).to_bytes(8, "little") + k + self.kv_value_bytes(key)

    def kv_digest(self, domain: bytes, keys: Iterable[str]) -> str:
        h = hashlib.sha256(domain)
        for key in sorted(keys, key=lambda k: k.encode("utf-8")):
            h.update(self.kv_bytes(key))
        return h.hexdigest()

    def metadata_digest(self) -> str:
        """sha256 over every metadata pair except ``dgr.slice.*`` and ``split.*`` (a split set's
        container pairs), sorted by key (docs/identity.md)."""
        return self.kv_digest(METADATA_DOMAIN, [k for k in self._fields if not k.startswith(DIGEST_EXCLUDED)])

    def tokenizer_digest(self) -> str:
        """sha256 over every ``tokenizer.*`` pair, sorted by key."""
        return self.kv_digest(TOKENIZER_DOMAIN, [k for k in self._fields if k.startswith("tokenizer.")])

    @property
    def is_slice(self) -> bool:
        return any(k.startswith(SLICE_PREFIX) for k in self._fields)

    # ---- model facts ----
    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GgufError(f"{self.path}: general.architecture is missing; not a model GGUF")
        return arch

    def hparam(self, name: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{name}", default)

    @property
    def n_layer(self) -> int:
        n = self.hparam("block_count")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise GgufError(f"{self.path}: {self.architecture}.block_count is missing or invalid")
        return n

    # ---- tensors ----
    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise GgufError(f"{self.path}: no tensor named {name!r}") from None

    def has_tensor(self, name: str) -> bool:
        return name in self._by_name

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's exact bytes: a read-only uint8 view of the mapped file (release it before close)."""
        t = self.tensor(name)
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.n_bytes, offset=t.offset)

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a tensor view; the map goes when it does
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()

    def __enter__(self) -> "GgufFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gguf(path: str | Path) -> GgufFile:
    """Open and validate a GGUF file; a missing, truncated or corrupt file is a GgufError."""
    p = Path(path)
    if not p.is_file():
        raise GgufError(f"GGUF file not found: {p}")
    size = p.stat().st_size
    if size < 24:
        raise GgufError(f"{p} is not a readable GGUF file, truncated or corrupt ({size} bytes, "
                        "shorter than a GGUF header)", hint="re-download or re-create it")
    return GgufFile(p)


# ---- inspect ----

def tensor_groups(tensors: list[TensorInfo]) -> list[dict[str, Any]]:
    """Tensors grouped by range: token embedding, runs of layers with identical layout, output."""
    head = [t for t in tensors if layer_of(t.name) is None and t.name.startswith("token_embd")]
    tail = [t for t in tensors if layer_of(t.name) is None and t.name.startswith("output")]
    other = [t for t in tensors if layer_of(t.name) is None and t not in head and t not in tail]
    layers: dict[int, list[TensorInfo]] = {}
    for t in tensors:
        i = layer_of(t.name)
        if i is not None:
            layers.setdefault(i, []).append(t)

    def desc(ts: list[TensorInfo]) -> dict[str, Any]:
        return {"tensors": len(ts), "bytes": sum(t.n_bytes for t in ts),
                "types": dict(sorted(Counter(t.type_name for t in ts).items()))}

    groups: list[dict[str, Any]] = []
    if head:
        groups.append({"range": "head", "names": [t.name for t in head], **desc(head)})
    # Runs of consecutive layers with the same (suffix, type, shape) layout.
    run: list[int] = []
    run_sig: Any = None
    for i in sorted(layers):
        sig = tuple(sorted((t.name.split(".", 2)[2], t.type_name, t.shape) for t in layers[i]))
        if run and sig == run_sig and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            groups.append(_layer_group(run, layers))
        run, run_sig = [i], sig
    if run:
        groups.append(_layer_group(run, layers))
    if tail:
        groups.append({"range": "tail", "names": [t.name for t in tail], **desc(tail)})
    if other:
        groups.append({"range": "global", "names": [t.name for t in other], **desc(other)})
    return groups


def _layer_group(run: list[int], layers: dict[int, list[TensorInfo]]) -> dict[str, Any]:
    ts = [t for i in run for t in layers[i]]
    rng = f"blk.{run[0]}" if len(run) == 1 else f"blk.{run[0]}..{run[-1]}"
    first = layers[run[0]]
    return {"range": rng, "layers": len(run), "tensors": len(ts), "bytes": sum(t.n_bytes for t in ts),
            "bytes_per_layer": sum(t.n_bytes for t in first),
            "types": dict(sorted(Counter(t.type_name for t in ts).items())),
            "names": sorted(t.name.split(".", 2)[2] for t in first)}


def tokenizer_summary(gf: GgufFile) -> dict[str, Any]:
    n_vocab = gf.array_len("tokenizer.ggml.tokens") or 0
    out: dict[str, Any] = {"model": gf.get("tokenizer.ggml.model"), "pre": gf.get("tokenizer.ggml.pre"),
                           "n_vocab": n_vocab}
    for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        v = gf.get(f"tokenizer.ggml.{k}")
        if v is not None:
            out[k] = v
    n_merges = gf.array_len("tokenizer.ggml.merges")
    if n_merges is not None:
        out["n_merges"] = n_merges
    out["chat_template"] = gf.has("tokenizer.chat_template")
    out["digest"] = gf.tokenizer_digest()
    return out


def inspect(path: str | Path) -> dict[str, Any]:
    """A summary of one GGUF file: architecture, hyper-parameters, tensors by range, tokenizer
    (a split set as a whole: :func:`dgr.gguf.gguf_set.inspect_model`)."""
    with open_gguf(path) as gf:
        return summary(gf)


def summary(gf: Any) -> dict[str, Any]:
    """:func:`inspect`'s summary of an opened GgufFile (or anything that reads like one)."""
    arch = gf.get("general.architecture")
    hp: dict[str, Any] = {}
    if isinstance(arch, str):
        for name in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                     "attention.head_count_kv", "context_length", "rope.dimension_count",
                     "attention.layer_norm_rms_epsilon", "rope.freq_base", "vocab_size"):
            v = gf.get(f"{arch}.{name}")
            if v is not None:
                hp[name] = v
    slice_info = {k[len(SLICE_PREFIX):]: gf.get(k) for k in gf.keys
                  if k.startswith(SLICE_PREFIX) and k not in (SLICE_PREFIX + "source_manifest",
                                                                SLICE_PREFIX + "tensor_entries")}
    return {
        "path": str(gf.path), "file_bytes": gf.size, "gguf_version": gf.version,
        "name": gf.get("general.name"), "architecture": arch, "hparams": hp,
        "file_type": gf.get("general.file_type"), "n_kv": len(gf.keys), "n_tensors": len(gf.tensors),
        "tensor_bytes": sum(t.n_bytes for t in gf.tensors),
        "types": dict(sorted(Counter(t.type_name for t in gf.tensors).items())),
        "tied_output": None if gf.is_slice else (
            gf.has_tensor("token_embd.weight") and not gf.has_tensor("output.weight")),
        "groups": tensor_groups(gf.tensors),
        "tokenizer": tokenizer_summary(gf),
        "slice": slice_info or None,
    }
