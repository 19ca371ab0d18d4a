"""A seeded generator of corrupt GGUF files for the GGUF reader fuzz tests (tests/test_fuzz_gguf.py).

`layout(data)` walks a valid GGUF's header on its own (it does not use the reader under test)
and lists every structural field with its offset and width; `corpus(data, seed, n)` yields
`Corruption`s built from those fields: truncations, bit flips, huge counts, zero and
overflowing dimensions, bad dimension counts, bad ggml and value types, bad string lengths,
invalid UTF-8, misaligned or far tensor offsets, bad versions, and stacks of several.
`flip_tensor_byte(path, name)` alters one byte of a tensor's data in place (a tampered file whose
header still reads: identity and slice verification must catch it).
`must_refuse` marks the corruptions that no reader may accept (the file is not a valid GGUF
whatever the rest of it holds); the others (a flipped bit may land in tensor data) may open.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

U64_EDGES = (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
VTYPE_COUNT = 13   # GGUF metadata value types 0..12


@dataclass(frozen=True)
class Field:
    kind: str      # magic, version, n_tensors, n_kv, key_len, key, vtype, str_len, str, scalar,
                   # arr_type, arr_count, name_len, name, n_dims, dim, ggml_type, tensor_offset
    offset: int
    width: int
    owner: str = ""  # key or tensor name
    value: int = 0   # the integer read there (widths 4 and 8)


@dataclass(frozen=True)
class Layout:
    fields: tuple[Field, ...]
    header_end: int   # end of the tensor info table (before alignment padding)
    n_tensors: int
    size: int

    def of(self, *kinds: str) -> list[Field]:
        return [f for f in self.fields if f.kind in kinds]


@dataclass(frozen=True)
class Corruption:
    kind: str
    data: bytes
    must_refuse: bool


def layout(data: bytes) -> Layout:
    """Every structural field of a valid little-endian GGUF v3 file."""
    fields: list[Field] = []
    pos = 0

    def take(kind: str, width: int, owner: str = "") -> int:
        nonlocal pos
        v = int.from_bytes(data[pos:pos + width], "little") if width in (4, 8) else 0
        fields.append(Field(kind, pos, width, owner, v))
        pos += width
        return v

    def string(len_kind: str, kind: str, owner: str = "") -> str:
        n = take(len_kind, 8, owner)
        s = data[pos:pos + n].decode("utf-8")
        take(kind, n, owner or s)
        return s

    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(vtype: int, owner: str) -> None:
        nonlocal pos
        if vtype in scalar:
            take("scalar", scalar[vtype], owner)
        elif vtype == 8:
            string("str_len", "str", owner)
        elif vtype == 9:
            itype = take("arr_type", 4, owner)
            count = take("arr_count", 8, owner)
            for i in range(count):
                if itype in scalar and i > 2:  # a long scalar array: its first items are enough
                    pos += scalar[itype] * (count - i)
                    break
                value(itype, owner)
        else:
            raise ValueError(f"not a valid GGUF: value type {vtype}")

    take("magic", 4)
    take("version", 4)
    n_tensors = take("n_tensors", 8)
    n_kv = take("n_kv", 8)
    for _ in range(n_kv):
        key = string("key_len", "key")
        value(take("vtype", 4, key), key)
    for _ in range(n_tensors):
        name = string("name_len", "name")
        n_dims = take("n_dims", 4, name)
        for _ in range(n_dims):
            take("dim", 8, name)
        take("ggml_type", 4, name)
        take("tensor_offset", 8, name)
    return Layout(tuple(fields), pos, n_tensors, len(data))


def _put(buf: bytearray, f: Field, value: int) -> None:
    buf[f.offset:f.offset + f.width] = (value % (1 << (8 * f.width))).to_bytes(f.width, "little")


def _dims_of(lay: Layout, name: str) -> list[Field]:
    return [f for f in lay.fields if f.kind == "dim" and f.owner == name]


def corrupt_once(data: bytes, lay: Layout, rng: random.Random) -> Corruption:
    """One corruption of ``data``, its kind chosen by ``rng``."""
    buf = bytearray(data)
    kind = rng.choice(KINDS)
    refuse = True
    if kind == "truncate_header":
        buf = buf[:rng.randrange(0, lay.header_end)]
    elif kind == "truncate_data":
        # cutting inside the tensor data leaves at least one tensor running past the end
        last_data = max(lay.header_end + 1, lay.size - 64)
        buf = buf[:rng.randrange(lay.header_end, last_data)]
        refuse = False  # the cut may fall in the last tensor's alignment padding
    elif kind == "bitflip":
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(0, lay.header_end) if rng.random() < 0.8 else rng.randrange(0, len(buf))
            buf[at] ^= 1 << rng.randrange(8)
        refuse = False
    elif kind == "byte_set":
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(0, lay.header_end)] = rng.choice((0x00, 0x7F, 0x80, 0xFF))
        refuse = False
    elif kind == "huge_count":
        f = rng.choice(lay.of("n_tensors", "n_kv"))
        _put(buf, f, rng.choice((2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1, lay.size)))
    elif kind == "huge_length":
        f = rng.choice(lay.of("key_len", "str_len", "name_len"))
        _put(buf, f, rng.choice((lay.size, 2**32, 2**63 - 1, 2**63, 2**64 - 1)))
    elif kind == "length_edge":
        f = rng.choice(lay.of("key_len", "str_len", "name_len", "arr_count"))
        _put(buf, f, rng.choice(U64_EDGES + (f.value + 1, max(f.value - 1, 0))))
        refuse = False  # a shorter length may still parse as another valid layout
    elif kind == "huge_array":
        f = rng.choice(lay.of("arr_count"))
        _put(buf, f, rng.choice((lay.size, 2**32, 2**61, 2**63, 2**64 - 1)))
    elif kind == "zero_dim":
        name = rng.choice([f.owner for f in lay.of("n_dims")])
        dims = _dims_of(lay, name)
        _put(buf, rng.choice(dims), 0)
    elif kind == "negative_dim":
        name = rng.choice([f.owner for f in lay.of("n_dims")])
        _put(buf, rng.choice(_dims_of(lay, name)), rng.choice((2**63, 2**64 - 1, 2**64 - 32)))
    elif kind == "overflow_dims":
        # every dimension large: the element count (or byte size) overflows 64 bits
        name = rng.choice([f.owner for f in lay.of("n_dims") if f.value >= 2])
        for d in _dims_of(lay, name):
            _put(buf, d, rng.choice((2**32, 2**33, 2**40, 2**62 - 256, 2**63 - 256)))
    elif kind == "huge_dim":
        name = rng.choice([f.owner for f in lay.of("n_dims")])
        _put(buf, rng.choice(_dims_of(lay, name)), rng.choice((2**31, 2**32 + 256, 2**48, 2**62)))
    elif kind == "n_dims":
        f = rng.choice(lay.of("n_dims"))
        _put(buf, f, rng.choice((0, 5, 8, 2**31, 2**32 - 1)))
    elif kind == "ggml_type":
        f = rng.choice(lay.of("ggml_type"))
        _put(buf, f, rng.choice((4, 5, 64, 255, 2**31, 2**32 - 1)))  # 4, 5: removed types
    elif kind == "vtype":
        f = rng.choice(lay.of("vtype", "arr_type"))
        _put(buf, f, rng.choice((13, 14, 255, 2**31, 2**32 - 1)))
    elif kind == "vtype_swap":
        f = rng.choice(lay.of("vtype", "arr_type"))
        _put(buf, f, rng.randrange(VTYPE_COUNT))
        refuse = False
    elif kind == "tensor_offset":
        f = rng.choice(lay.of("tensor_offset"))
        _put(buf, f, rng.choice((f.value + 1, f.value + 3, lay.size, 2**63, 2**64 - 32, 2**64 - 1)))
    elif kind == "bad_utf8":
        f = rng.choice([f for f in lay.of("key", "name") if f.width > 0])
        buf[f.offset + rng.randrange(f.width)] = rng.choice((0xFF, 0xC0, 0x80, 0xED))
        refuse = False  # 0x80 inside a multi-byte sequence may still be valid UTF-8 in rare cases
    elif kind == "version":
        _put(buf, lay.of("version")[0], rng.choice((0, 1, 4, 0x03000000, 2**32 - 1)))
    elif kind == "magic":
        buf[rng.randrange(4)] ^= 1 << rng.randrange(8)
    elif kind == "duplicate_name":
        names = lay.of("name")
        a, b = rng.sample(names, 2) if len(names) >= 2 else (names[0], names[0])
        if a.width == b.width and a is not b:
            buf[b.offset:b.offset + b.width] = data[a.offset:a.offset + a.width]
        else:
            refuse = False
    elif kind == "stack":
        refuse = False
        for _ in range(rng.randint(2, 4)):
            sub = corrupt_once(bytes(buf), lay, rng)
            buf = bytearray(sub.data)  # a later field write may undo an earlier corruption:
            if len(buf) < lay.header_end:   # a stack is only required not to crash
                break
    return Corruption(kind, bytes(buf), refuse)


KINDS = ("truncate_header", "truncate_data", "bitflip", "byte_set", "huge_count", "huge_length",
         "length_edge", "huge_array", "zero_dim", "negative_dim", "overflow_dims", "huge_dim", "n_dims",
         "ggml_type", "vtype", "vtype_swap", "tensor_offset", "bad_utf8", "version", "magic",
         "duplicate_name", "stack")


def corpus(data: bytes, seed: int, n: int) -> Iterator[Corruption]:
    """``n`` corruptions of the valid GGUF ``data``, the same for the same seed."""
    lay = layout(data)
    rng = random.Random(seed)
    for _ in range(n):
        yield corrupt_once(data, lay, rng)


def flip_tensor_byte(path: Path, name: str) -> None:
    """Alters one byte in the middle of tensor ``name``'s data, in place."""
    from dgr.gguf.inspect import open_gguf

    with open_gguf(path) as gf:
        t = next(t for t in gf.tensors if t.name == name)
        at = t.offset + t.n_bytes // 2
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
