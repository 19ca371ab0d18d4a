"""Cut a GGUF into a split set the way llama.cpp's gguf-split lays one out (tests only):
``PREFIX-00001-of-0000N.gguf`` … with ``split.no`` (u16), ``split.count`` (u16) and
``split.tensors.count`` (i32) in every part; part 1 carries every metadata pair of the source
(copied byte for byte), the tensors are dealt out in file order. Written by hand (a few dozen
lines over gguf-py's reader) so that the default lane needs no llama-gguf-split build."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGUFReader


def _kv_u16(key: str, v: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IH", 2, v)


def _kv_i32(key: str, v: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<Ii", 5, v)


def part_path(prefix: Path, i: int, n: int) -> Path:
    return prefix.parent / f"{prefix.name}-{i + 1:05d}-of-{n:05d}.gguf"


def split_gguf(src: Path, prefix: Path, n_parts: int) -> list[Path]:
    """Writes the parts; returns their paths (part 1 first)."""
    r = GGUFReader(src)
    pairs = [b"".join(bytes(p.tobytes()) for p in f.parts) for name, f in r.fields.items()
             if not name.startswith("GGUF.")]
    align = 32
    if "general.alignment" in r.fields:
        align = int(r.fields["general.alignment"].parts[-1][0])
    tensors = list(r.tensors)
    per = -(-len(tensors) // n_parts)
    chunks = [tensors[i * per:(i + 1) * per] for i in range(n_parts)]
    assert all(chunks), "more parts than tensors"
    out = []
    for i, chunk in enumerate(chunks):
        kvs = (pairs if i == 0 else []) + [_kv_u16("split.no", i), _kv_u16("split.count", n_parts),
                                           _kv_i32("split.tensors.count", len(tensors))]
        a = align if i == 0 else 32
        infos, datas, off = [], [], 0
        for t in chunk:
            name = t.name.encode()
            dims = [int(d) for d in t.field.parts[3]]
            infos.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
                         + b"".join(struct.pack("<Q", d) for d in dims)
                         + struct.pack("<IQ", int(t.tensor_type), off))
            raw = np.asarray(t.data).tobytes()
            assert len(raw) == t.n_bytes, t.name
            pad = (-len(raw)) % a
            datas.append(raw + b"\0" * pad)
            off += len(raw) + pad
        head = b"GGUF" + struct.pack("<IQQ", 3, len(chunk), len(kvs)) + b"".join(kvs) + b"".join(infos)
        head += b"\0" * ((-len(head)) % a)
        p = part_path(prefix, i, n_parts)
        p.write_bytes(head + b"".join(datas))
        out.append(p)
    return out
