"""Split GGUF sets (llama.cpp's gguf-split format) read as one model (docs/identity.md).

A set of N parts is N files ``PREFIX-%05d-of-%05d.gguf``; every part carries ``split.no`` (u16,
0-based), ``split.count`` (u16, N) and ``split.tensors.count`` (i32, the total over all parts);
part 1 holds every model metadata pair, the others only ``split.*``. :func:`open_model` opens a
single file or a whole set (given the path of any part) and checks the set's structure, refusing
a missing, extra, reordered or mismatched part with a one-line error naming it. Each part is
read by the strict per-file reader (:func:`dgr.gguf.inspect.open_gguf`).

A :class:`GgufSet` answers like a :class:`~dgr.gguf.inspect.GgufFile`: metadata from part 1,
tensors from every part (their data read from the part that holds them; ``parts_read`` records
which parts' tensor data was touched).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Union

import numpy as np

from .inspect import (SLICE_PREFIX, SPLIT_PREFIX, T_INT32, T_UINT16, GgufError, GgufFile, TensorInfo, layer_of,
                      open_gguf)

K_SPLIT_NO = "split.no"
K_SPLIT_COUNT = "split.count"
K_SPLIT_TENSORS = "split.tensors.count"
# Pairs a part other than part 1 may hold: its split.* pairs and its own container's alignment.
_CONTAINER_KEYS = ("general.alignment",)
MAX_PARTS = 0xFFFF
_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class SplitSetError(GgufError):
    """A split set that is incomplete or inconsistent."""


@dataclass(frozen=True)
class SplitName:
    prefix: str   # file-name prefix (without the folder)
    no: int       # 1-based, as in the name
    count: int


def split_name(name: str) -> SplitName | None:
    """``PREFIX-NNNNN-of-MMMMM.gguf`` -> its parts, else None."""
    m = _NAME.match(name)
    if m is None:
        return None
    return SplitName(m.group("prefix"), int(m.group("no")), int(m.group("count")))


def part_name(prefix: str, no: int, count: int) -> str:
    """llama.cpp's ``llama_split_path``: PREFIX-%05d-of-%05d.gguf, ``no`` 1-based."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def part_paths(path: str | Path) -> list[Path]:
    """The N file paths of the set a part's name names (by name only, nothing is opened)."""
    p = Path(path)
    sn = split_name(p.name)
    if sn is None:
        return [p]
    return [p.with_name(part_name(sn.prefix, i, sn.count)) for i in range(1, sn.count + 1)]


@dataclass(frozen=True)
class PartSummary:
    """One part of a set, for `dgr gguf inspect`."""
    index: int             # 1-based
    path: str
    file_bytes: int
    n_tensors: int
    tensor_bytes: int
    layers: tuple[int, ...]    # block indices with at least one tensor in this part
    globals: tuple[str, ...]   # tensors outside blk.N.* (token_embd, output, ...)

    def layer_text(self) -> str:
        """'0..5', '3', '0..2, 4' or '-'."""
        if not self.layers:
            return "-"
        runs: list[list[int]] = []
        for i in self.layers:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "path": self.path, "file_bytes": self.file_bytes,
                "n_tensors": self.n_tensors, "tensor_bytes": self.tensor_bytes,
                "layers": self.layer_text(), "globals": list(self.globals)}


class GgufSet:
    """An opened, checked split set: metadata from part 1, tensors from every part."""

    def __init__(self, parts: list[GgufFile], prefix: str) -> None:
        self.parts = parts
        self.prefix = prefix
        first = parts[0]
        self.path: Path = first.path                # part 1: what llama.cpp and the worker are given
        self.part_paths: list[Path] = [p.path for p in parts]
        self.size = sum(p.size for p in parts)
        self.version = first.version
        self.alignment = first.alignment
        self.little_endian = True
        self.tensors: list[TensorInfo] = [t for p in parts for t in p.tensors]
        self._part_of = {t.name: i for i, p in enumerate(parts) for t in p.tensors}
        self.parts_read: set[int] = set()           # 0-based indices of parts whose tensor data was read

    @property
    def first(self) -> GgufFile:
        return self.parts[0]

    @property
    def n_parts(self) -> int:
        return len(self.parts)

    def label(self) -> str:
        return f"split set {part_name(self.prefix, 1, self.n_parts)} ({self.n_parts} parts)"

    # ---- metadata: part 1 ----
    @property
    def keys(self) -> list[str]:
        return self.first.keys

    def has(self, key: str) -> bool:
        return self.first.has(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.first.get(key, default)

    def value_type(self, key: str) -> int:
        return self.first.value_type(key)

    def array_len(self, key: str) -> int | None:
        return self.first.array_len(key)

    def kv_value_bytes(self, key: str) -> bytes:
        return self.first.kv_value_bytes(key)

    def kv_bytes(self, key: str) -> bytes:
        return self.first.kv_bytes(key)

    def kv_digest(self, domain: bytes, keys: Iterable[str]) -> str:
        return self.first.kv_digest(domain, keys)

    def metadata_digest(self) -> str:
        return self.first.metadata_digest()

    def tokenizer_digest(self) -> str:
        return self.first.tokenizer_digest()

    @property
    def is_slice(self) -> bool:
        return False  # refused when opening: slices are single files

    @property
    def architecture(self) -> str:
        return self.first.architecture

    def hparam(self, name: str, default: Any = None) -> Any:
        return self.first.hparam(name, default)

    @property
    def n_layer(self) -> int:
        return self.first.n_layer

    # ---- tensors: every part ----
    def part_of(self, name: str) -> int:
        """0-based index of the part holding tensor ``name``."""
        try:
            return self._part_of[name]
        except KeyError:
            raise GgufError(f"{self.label()}: no tensor named {name!r}") from None

    def tensor(self, name: str) -> TensorInfo:
        return self.parts[self.part_of(name)].tensor(name)

    def has_tensor(self, name: str) -> bool:
        return name in self._part_of

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's exact bytes, a read-only view of the part that holds it."""
        i = self.part_of(name)
        self.parts_read.add(i)
        return self.parts[i].tensor_bytes(name)

    def summaries(self) -> list[PartSummary]:
        out = []
        for i, p in enumerate(self.parts):
            layers = sorted({n for n in (layer_of(t.name) for t in p.tensors) if n is not None})
            out.append(PartSummary(i + 1, str(p.path), p.size, len(p.tensors), sum(t.n_bytes for t in p.tensors),
                                   tuple(layers), tuple(t.name for t in p.tensors if layer_of(t.name) is None)))
        return out

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def __enter__(self) -> "GgufSet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


GgufModel = Union[GgufFile, GgufSet]


def _int_pair(gf: GgufFile, key: str, vtype: int, tname: str, where: str) -> int:
    if not gf.has(key):
        raise SplitSetError(f"{where}: {gf.path.name} has no {key} pair")
    if gf.value_type(key) != vtype:
        raise SplitSetError(f"{where}: {gf.path.name}'s {key} is not a {tname}")
    return int(gf.get(key))


def _check_set(parts: list[GgufFile], prefix: str) -> None:
    n = len(parts)
    where = f"split set {part_name(prefix, 1, n)} ({n} parts)"
    total = _int_pair(parts[0], K_SPLIT_TENSORS, T_INT32, "i32", where)
    if any(k.startswith(SLICE_PREFIX) for k in parts[0].keys):
        raise SplitSetError(f"{where}: {parts[0].path.name} carries {SLICE_PREFIX}* pairs; a dgr slice is "
                            "never a split set", hint="slice the original set again")
    seen: dict[str, str] = {}
    for i, gf in enumerate(parts):
        name = gf.path.name
        count = _int_pair(gf, K_SPLIT_COUNT, T_UINT16, "u16", where)
        if count != n:
            raise SplitSetError(f"{where}: {name} has split.count {count}, not {n} (mismatched part)",
                                hint="every part must come from the same split")
        no = _int_pair(gf, K_SPLIT_NO, T_UINT16, "u16", where)
        if no != i:
            raise SplitSetError(f"{where}: {name} holds split.no {no} (part {no + 1}), not part {i + 1} "
                                "(parts renamed or reordered)", hint="restore the original file names")
        tc = _int_pair(gf, K_SPLIT_TENSORS, T_INT32, "i32", where)
        if tc != total:
            raise SplitSetError(f"{where}: {name} has split.tensors.count {tc}, part 1 has {total} "
                                "(mismatched part)", hint="every part must come from the same split")
        if i > 0:
            extra = [k for k in gf.keys if not k.startswith(SPLIT_PREFIX) and k not in _CONTAINER_KEYS]
            if extra:
                raise SplitSetError(f"{where}: {name} carries model metadata ({extra[0]!r}); only part 1 may "
                                    "(mismatched part)", hint="every part must come from the same split")
        for t in gf.tensors:
            other = seen.get(t.name)
            if other is not None:
                raise SplitSetError(f"{where}: tensor {t.name!r} is in both {other} and {name} (mismatched part)")
            seen[t.name] = name
    if len(seen) != total:
        raise SplitSetError(f"{where}: the parts hold {len(seen)} tensors, split.tensors.count says {total} "
                            f"(mismatched part: {parts[-1].path.name} and its siblings do not add up)")


def open_set(path: str | Path) -> GgufSet:
    """Open and check the whole set named by any of its parts (``PREFIX-NNNNN-of-MMMMM.gguf``)."""
    p = Path(path)
    sn = split_name(p.name)
    if sn is None:
        raise SplitSetError(f"{p.name} is not named PREFIX-NNNNN-of-MMMMM.gguf, the name of a split-set part")
    where = f"split set {part_name(sn.prefix, 1, sn.count)} ({sn.count} parts)"
    if not 1 <= sn.count <= MAX_PARTS or not 1 <= sn.no <= sn.count:
        raise SplitSetError(f"{p.name}: part {sn.no} of {sn.count} is not a valid split-set part name")
    expected = part_paths(p)
    wanted = {q.name for q in expected}
    folder = p.parent
    strays = sorted(q.name for q in folder.iterdir()
                    if (s := split_name(q.name)) is not None and s.prefix == sn.prefix and q.name not in wanted)
    for q in expected:
        if not q.is_file():
            raise SplitSetError(f"{where}: part {q.name} is missing", hint=f"all {sn.count} parts must sit in {folder}")
    if strays:
        raise SplitSetError(f"{where}: {strays[0]} in the same folder is not one of its {sn.count} parts (extra part)",
                            hint="remove or move the left-over file")
    parts: list[GgufFile] = []
    try:
        for q in expected:
            parts.append(open_gguf(q))
        _check_set(parts, sn.prefix)
    except BaseException:
        for gf in parts:
            gf.close()
        raise
    return GgufSet(parts, sn.prefix)


def open_model(path: str | Path) -> GgufModel:
    """A single GGUF file, or the whole split set when ``path`` names a part of one (any part).

    Rules (docs/identity.md "Split GGUF sets"): a file whose ``split.count`` is 2 or more is a
    part, and must be named ``PREFIX-NNNNN-of-MMMMM.gguf`` (else: a renamed part, refused); a
    file without ``split.count`` or with ``split.count`` <= 1 (llama-gguf-split's ``--merge``
    output has 0) is a single file, unless its name says it is part of a set of two or more
    while it has no ``split.count`` at all (refused)."""
    p = Path(path)
    gf = open_gguf(p)
    sn = split_name(p.name)
    if gf.has(K_SPLIT_COUNT) and gf.value_type(K_SPLIT_COUNT) != T_UINT16:
        gf.close()
        raise SplitSetError(f"{p.name}: split.count is not a u16 (a split-set part's pair)")
    count = gf.get(K_SPLIT_COUNT)
    if count is None or count <= 1:
        if sn is not None and sn.count >= 2 and count is None:
            gf.close()
            raise SplitSetError(f"{p.name} is named as part {sn.no} of {sn.count} but has no split.count pair "
                                "(not a llama-gguf-split part)")
        return gf
    no = gf.get(K_SPLIT_NO)
    gf.close()
    if sn is None:
        ordinal = no + 1 if isinstance(no, int) else "?"
        raise SplitSetError(f"{p.name} is part {ordinal} of a {count}-part split set, but its name is not "
                            "PREFIX-NNNNN-of-NNNNN.gguf (renamed part)",
                            hint="restore the part names llama-gguf-split gave them")
    return open_set(p)


def first_part(path: str | Path) -> Path:
    """The path to hand to llama.cpp and the worker: part 1 of a set (the whole set checked),
    else ``path`` (refused when it is a renamed part; a file that is not a readable GGUF is left
    to the reader that needs it, which names the problem)."""
    p = Path(path)
    if split_name(p.name) is None:
        try:
            gf = open_gguf(p)
        except GgufError:
            return p
        gf.close()
    with open_model(p) as m:
        return m.path


def is_set(m: GgufModel) -> bool:
    return isinstance(m, GgufSet)


def inspect_model(path: str | Path) -> dict[str, Any]:
    """`dgr gguf inspect`'s summary of a single file or of a whole split set (any part names
    it): for a set ``path`` is part 1's, ``file_bytes`` all parts together, and ``parts`` lists
    each part's file, size, tensors and the layers it holds (None for a single file)."""
    from .inspect import summary

    with open_model(path) as m:
        info = summary(m)
        info["parts"] = [s.to_json() for s in m.summaries()] if isinstance(m, GgufSet) else None
    return info


def model_stem(path: str | Path) -> str:
    """A model's short name: the file's stem, or a split set's PREFIX (``m-00001-of-00003.gguf`` -> ``m``)."""
    p = Path(path)
    sn = split_name(p.name)
    return sn.prefix if sn is not None else p.stem
