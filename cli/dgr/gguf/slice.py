"""Slicing a GGUF by layer range, and verifying a slice (docs/identity.md).

A slice is a GGUF holding only the tensors its range owns (``blk.N.*`` for N in [start, end);
``token_embd`` for a head; ``output_norm`` and ``output`` — or, for a tied model, ``token_embd``
— for a tail), with the original tensor names, every original metadata pair byte for byte, and
``dgr.slice.*`` pairs binding it to the source: the source artifact id, metadata and tokenizer
digests, the range and the full canonical source manifest. It never uses ``split.*`` keys
(llama.cpp reads those as pieces of one file): the slice of a split set (any part names it,
:mod:`dgr.gguf.gguf_set`) is a plain single file, its tensor data read only from the parts that
hold the range's tensors.

Which tensors a range owns is the architecture adapter's knowledge; an architecture without
an adapter fails closed: no guessing by tensor names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DgrError
from .gguf_set import GgufSet, open_model
from .inspect import SLICE_PREFIX, SPLIT_PREFIX, GgufFile, layer_of, open_gguf
from .identity import Manifest, ManifestError, TensorEntry, hash_tensors, identify
from ..console import Progress

SLICE_FORMAT_VERSION = 1
K_VERSION = SLICE_PREFIX + "version"
K_ARTIFACT = SLICE_PREFIX + "source_artifact_id"
K_METADATA = SLICE_PREFIX + "source_metadata_digest"
K_TOKENIZER = SLICE_PREFIX + "source_tokenizer_digest"
K_ADAPTER = SLICE_PREFIX + "arch_adapter"
K_ADAPTER_VERSION = SLICE_PREFIX + "arch_adapter_version"
K_START = SLICE_PREFIX + "layer_start"
K_END = SLICE_PREFIX + "layer_end"
K_NLAYER = SLICE_PREFIX + "n_layer"
K_HEAD = SLICE_PREFIX + "head"
K_TAIL = SLICE_PREFIX + "tail"
K_ENTRIES = SLICE_PREFIX + "tensor_entries"
K_MANIFEST = SLICE_PREFIX + "source_manifest"


class SliceError(DgrError):
    """A slice that cannot be made or does not verify."""


@dataclass(frozen=True)
class LayerRange:
    """A Shard's layer range [start, end)."""
    start: int
    end: int

    @classmethod
    def parse(cls, text: str) -> "LayerRange":
        try:
            a, b = text.split(":")
            rng = cls(int(a), int(b))
        except ValueError:
            raise DgrError(f"bad layer range {text!r}", hint="write START:END, e.g. 0:15 (END exclusive)") from None
        if rng.start < 0 or rng.end <= rng.start:
            raise DgrError(f"bad layer range {text!r}: need 0 <= START < END")
        return rng

    def check(self, n_layer: int) -> None:
        if not (0 <= self.start < self.end <= n_layer):
            raise SliceError(f"layer range {self} is outside the model's {n_layer} layers",
                             hint=f"use START:END with 0 <= START < END <= {n_layer}")

    def is_head(self) -> bool:
        return self.start == 0

    def is_tail(self, n_layer: int) -> bool:
        return self.end == n_layer

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


@dataclass(frozen=True)
class ArchAdapter:
    """What dgr knows of one architecture's tensor ownership. Bump ``version`` whenever the
    meaning of a boundary or of ownership changes (it is part of the recipe fingerprint).

    ``layer_roles`` names every per-layer tensor (``blk.N.<suffix>``) the adapter knows and its
    role (attention, qk_norm, norm, ffn, router, experts, ...); a per-layer tensor missing there
    fails closed like an unknown global tensor. ``None`` (llama v1) accepts any ``blk.N.*``."""
    name: str
    version: int
    head_tensors: frozenset[str]
    tail_tensors: frozenset[str]
    shared_tensors: frozenset[str]   # needed by every slice (e.g. rope_freqs)
    tied_tensor: str = "token_embd.weight"
    untied_output: str = "output.weight"
    layer_roles: dict[str, str] | None = None

    def role(self, name: str) -> str | None:
        """The role of a per-layer tensor (None for global tensors or an adapter without roles)."""
        if self.layer_roles is None or layer_of(name) is None:
            return None
        return self.layer_roles.get(name.split(".", 2)[2])

    def owner(self, name: str, n_layer: int) -> str:
        """'layer', 'head', 'tail', 'shared' — or SliceError for a tensor this adapter does not know."""
        i = layer_of(name)
        if i is not None:
            if i >= n_layer:
                raise SliceError(f"tensor {name} is beyond the model's {n_layer} layers")
            if self.layer_roles is not None and self.role(name) is None:
                raise SliceError(f"per-layer tensor {name!r} is unknown to the {self.name} adapter v{self.version}",
                                 hint="unknown tensors fail closed; extend the adapter deliberately")
            return "layer"
        for kind, names in (("head", self.head_tensors), ("tail", self.tail_tensors),
                            ("shared", self.shared_tensors)):
            if name in names:
                return kind
        raise SliceError(f"tensor {name!r} is unknown to the {self.name} adapter v{self.version}",
                         hint="unknown tensors fail closed; extend the adapter deliberately")

    def owned(self, names: list[str], rng: LayerRange, n_layer: int) -> list[str]:
        """The tensors a range owns, in the given order."""
        rng.check(n_layer)
        tied = self.untied_output not in names
        out = []
        for name in names:
            kind = self.owner(name, n_layer)
            if kind == "layer":
                keep = rng.start <= (layer_of(name) or 0) < rng.end
            elif kind == "head":
                keep = rng.is_head() or (tied and name == self.tied_tensor and rng.is_tail(n_layer))
            elif kind == "tail":
                keep = rng.is_tail(n_layer)
            else:
                keep = True
            if keep:
                out.append(name)
        return out


def _roles(**groups: str) -> dict[str, str]:
    """``role="suffix suffix ..."`` -> {suffix.weight: role}."""
    return {f"{sfx}.weight": role for role, sfxs in groups.items() for sfx in sfxs.split()}


_ATTN = "attn_q attn_k attn_v attn_output"
_DENSE_FFN = "ffn_gate ffn_up ffn_down"

ADAPTERS: dict[str, ArchAdapter] = {
    "llama": ArchAdapter(
        name="llama", version=1,
        head_tensors=frozenset({"token_embd.weight"}),
        tail_tensors=frozenset({"output_norm.weight", "output.weight"}),
        shared_tensors=frozenset({"rope_freqs.weight"}),
    ),
    # Gemma 3: interleaved sliding-window / global attention (both KV caches layer-filtered),
    # Q/K norms, post-attention and post-FFN norms, tied output, embedding scaled by sqrt(n_embd)
    # in the head only (the boundary carries the scaled residual stream).
    "gemma3": ArchAdapter(
        name="gemma3", version=1,
        head_tensors=frozenset({"token_embd.weight"}),
        tail_tensors=frozenset({"output_norm.weight", "output.weight"}),
        shared_tensors=frozenset(),
        layer_roles=_roles(attention=_ATTN, qk_norm="attn_q_norm attn_k_norm",
                           norm="attn_norm post_attention_norm ffn_norm post_ffw_norm", ffn=_DENSE_FFN),
    ),
    # Qwen3 dense: llama-like with per-head Q/K RMS norms, no QKV bias.
    "qwen3": ArchAdapter(
        name="qwen3", version=1,
        head_tensors=frozenset({"token_embd.weight"}),
        tail_tensors=frozenset({"output_norm.weight", "output.weight"}),
        shared_tensors=frozenset(),
        layer_roles=_roles(attention=_ATTN, qk_norm="attn_q_norm attn_k_norm", norm="attn_norm ffn_norm",
                           ffn=_DENSE_FFN),
    ),
    # Qwen3-MoE: Q/K norms, a softmax top-k router per layer and stacked expert tensors (no shared
    # experts in this variant); router and experts live in the layer that uses them.
    "qwen3moe": ArchAdapter(
        name="qwen3moe", version=1,
        head_tensors=frozenset({"token_embd.weight"}),
        tail_tensors=frozenset({"output_norm.weight", "output.weight"}),
        shared_tensors=frozenset(),
        layer_roles=_roles(attention=_ATTN, qk_norm="attn_q_norm attn_k_norm", norm="attn_norm ffn_norm",
                           router="ffn_gate_inp", experts="ffn_gate_exps ffn_up_exps ffn_down_exps"),
    ),
}


def adapter_for(arch: str) -> ArchAdapter:
    try:
        return ADAPTERS[arch]
    except KeyError:
        raise DgrError(f"architecture {arch!r} has no dgr adapter; unsupported architectures fail closed",
                       hint=f"supported: {', '.join(sorted(ADAPTERS))}") from None


def range_bytes_by_role(path: str | Path, rng: LayerRange) -> dict[str, int]:
    """Bytes of the tensors a range owns, by role: per-layer roles of the adapter (e.g. attention,
    router, experts), 'layer' for an adapter without roles, and 'head' / 'tail' / 'tied_output' /
    'shared'."""
    with open_model(path) as gf:
        adapter = adapter_for(gf.architecture)
        n_layer = gf.n_layer
        sizes = {t.name: t.n_bytes for t in gf.tensors}
    owned = adapter.owned(list(sizes), rng, n_layer)
    out: dict[str, int] = {}
    for name in owned:
        kind = adapter.owner(name, n_layer)
        key = (adapter.role(name) or "layer") if kind == "layer" else kind
        if kind == "head" and not rng.is_head():
            key = "tied_output"  # the tail of a tied model holds token_embd as its LM head
        out[key] = out.get(key, 0) + sizes[name]
    return out


# ---- writing ----

@dataclass(frozen=True)
class _RawValue:
    """A metadata value copied byte for byte (type u32 + canonical little-endian value)."""
    data: bytes


def _writer_class():
    import gguf

    class SliceWriter(gguf.GGUFWriter):
        """GGUFWriter that writes copied metadata values verbatim (exact bytes, empty arrays too)."""

        def write_kv_data_to_file(self) -> None:  # noqa: D102 - mirrors the parent
            if self.state is not gguf.gguf_writer.WriterState.HEADER:
                raise ValueError(f"expected the header to be written, got {self.state}")
            assert self.fout is not None
            for fout, kv_data in zip(self.fout, self.kv_data):
                buf = bytearray()
                for key, val in kv_data.items():
                    buf += self._pack_val(key, gguf.GGUFValueType.STRING, add_vtype=False)
                    if isinstance(val.value, _RawValue):
                        buf += val.value.data
                    else:
                        buf += self._pack_val(val.value, val.type, add_vtype=True, sub_type=val.sub_type)
                fout.write(buf)
            self.flush()
            self.state = gguf.gguf_writer.WriterState.KV_DATA

    return SliceWriter


@dataclass(frozen=True)
class SliceResult:
    path: Path
    range: LayerRange
    n_layer: int
    tensors: tuple[str, ...]
    source_artifact_id: str
    file_bytes: int
    # the files whose tensor data was copied (for a split set: only the parts holding the range)
    read_from: tuple[str, ...] = ()
    source_parts: int = 1   # files of the source (the parts of a split set)


def slice_gguf(src: str | Path, rng: LayerRange, out: str | Path, *, progress: bool = True) -> SliceResult:
    """Write the sub-GGUF that ``rng`` owns to ``out`` (atomically)."""
    import gguf

    src, out = Path(src), Path(out)
    from .models import refuse_home

    refuse_home(out.parent, "output folder")
    ident = identify(src, progress=progress)
    if out.exists() and out.resolve() in {Path(q).resolve() for q in (ident.parts or (ident.path,))}:
        raise SliceError("the slice output would overwrite its source", hint="choose another -o path")
    with open_model(src) as gf:
        if gf.is_slice:
            raise SliceError(f"{src} is already a slice (has {SLICE_PREFIX}* metadata); slicing a slice is refused",
                             hint="slice the original artifact instead")
        if not gf.little_endian:
            raise SliceError(f"{src} is a big-endian GGUF; slicing supports little-endian files only")
        if gf.metadata_digest() != ident.metadata_digest:
            raise SliceError(f"{src} changed while it was being read", hint="try again")
        arch = gf.architecture
        adapter = adapter_for(arch)
        n_layer = gf.n_layer
        names = adapter.owned([t.name for t in gf.tensors], rng, n_layer)
        by_name = ident.manifest.by_name()
        entries = [by_name[n] for n in names]

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        w = _writer_class()(tmp, arch)
        w.data_alignment = gf.alignment
        for key in gf.keys:
            if key == "general.architecture" or key.startswith(SPLIT_PREFIX):
                continue  # the writer adds the architecture first (same value and type); a slice is one file
            w.add_key_value(key, _RawValue(gf.kv_value_bytes(key)), gguf.GGUFValueType.STRING)
        w.add_uint32(K_VERSION, SLICE_FORMAT_VERSION)
        w.add_string(K_ARTIFACT, ident.artifact_id)
        w.add_string(K_METADATA, ident.metadata_digest)
        w.add_string(K_TOKENIZER, ident.tokenizer_digest)
        w.add_string(K_ADAPTER, adapter.name)
        w.add_uint32(K_ADAPTER_VERSION, adapter.version)
        w.add_uint32(K_START, rng.start)
        w.add_uint32(K_END, rng.end)
        w.add_uint32(K_NLAYER, n_layer)
        w.add_bool(K_HEAD, rng.is_head())
        w.add_bool(K_TAIL, rng.is_tail(n_layer))
        w.add_key_value(K_ENTRIES, [e.line() for e in entries], gguf.GGUFValueType.ARRAY,
                        sub_type=gguf.GGUFValueType.STRING)
        w.add_string(K_MANIFEST, ident.manifest.text())
        for n in names:
            t = gf.tensor(n)
            w.add_tensor_info(n, t.byte_shape, np.dtype(np.uint8), t.n_bytes,
                              gguf.GGMLQuantizationType(t.ggml_type))
        total = sum(e.n_bytes for e in entries)
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            bar = Progress(f"writing {out.name}", total) if progress else None
            for n in names:
                data = gf.tensor_bytes(n).reshape(gf.tensor(n).byte_shape)
                w.write_tensor_data(data)
                del data
                if bar:
                    bar.update(gf.tensor(n).n_bytes)
            if bar:
                bar.close()
            w.close()
            # Self-check: the copied metadata reproduces the source's digest exactly.
            with open_gguf(tmp) as sf:
                if sf.metadata_digest() != ident.metadata_digest:
                    raise SliceError("internal error: the slice's copied metadata differs from the source")
            tmp.replace(out)
        finally:
            tmp.unlink(missing_ok=True)
        read_from = tuple(str(gf.part_paths[i]) for i in sorted(gf.parts_read)) if isinstance(gf, GgufSet) \
            else ((str(gf.path),) if names else ())
    return SliceResult(out, rng, n_layer, tuple(names), ident.artifact_id, out.stat().st_size, read_from,
                       max(1, len(ident.parts)))


# ---- verifying ----

@dataclass(frozen=True)
class SliceInfo:
    """The ``dgr.slice.*`` pairs of a slice, parsed."""
    source_artifact_id: str
    source_metadata_digest: str
    source_tokenizer_digest: str
    arch_adapter: str
    arch_adapter_version: int
    range: LayerRange
    n_layer: int
    head: bool
    tail: bool
    entries: tuple[TensorEntry, ...]
    source_manifest: Manifest


def read_slice_info(gf: GgufFile) -> SliceInfo:
    if not gf.is_slice:
        raise SliceError(f"{gf.path} is not a dgr slice (no {SLICE_PREFIX}* metadata)")
    version = gf.get(K_VERSION)
    if version != SLICE_FORMAT_VERSION:
        raise SliceError(f"{gf.path}: slice format version {version!r} is not supported (want {SLICE_FORMAT_VERSION})")
    try:
        def req(key: str, typ: type) -> Any:
            v = gf.get(key)
            if not isinstance(v, typ):
                raise SliceError(f"{gf.path}: slice metadata {key} is missing or has the wrong type")
            return v

        entries_raw = req(K_ENTRIES, list)
        return SliceInfo(
            source_artifact_id=req(K_ARTIFACT, str), source_metadata_digest=req(K_METADATA, str),
            source_tokenizer_digest=req(K_TOKENIZER, str), arch_adapter=req(K_ADAPTER, str),
            arch_adapter_version=req(K_ADAPTER_VERSION, int),
            range=LayerRange(req(K_START, int), req(K_END, int)), n_layer=req(K_NLAYER, int),
            head=req(K_HEAD, bool), tail=req(K_TAIL, bool),
            entries=tuple(TensorEntry.parse(line) for line in entries_raw),
            source_manifest=Manifest.parse(req(K_MANIFEST, str)),
        )
    except ManifestError as exc:
        raise SliceError(f"{gf.path}: slice manifest is damaged: {exc}") from None


@dataclass(frozen=True)
class SliceReport:
    path: str
    range: LayerRange
    n_layer: int
    source_artifact_id: str
    tensors: int
    checks: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "range": str(self.range), "n_layer": self.n_layer,
                "source_artifact_id": self.source_artifact_id, "tensors": self.tensors,
                "checks": list(self.checks), "ok": True}


def verify_slice(path: str | Path, source: str | Path | None = None, *,
                 expect_range: LayerRange | None = None, progress: bool = True) -> SliceReport:
    """Check a slice against its own embedded manifest and, given the source, against the source.

    Raises SliceError listing every problem found.
    """
    path = Path(path)
    problems: list[str] = []
    checks: list[str] = []
    with open_gguf(path) as gf:
        info = read_slice_info(gf)
        man = info.source_manifest
        # 1. the embedded manifest is the one the artifact id names
        if man.artifact_id != info.source_artifact_id:
            problems.append("embedded source manifest does not hash to the slice's source artifact id")
        else:
            checks.append("source manifest matches artifact id")
        # 2. metadata: copied pairs reproduce the source metadata digest
        if man.metadata_digest != info.source_metadata_digest:
            problems.append("source metadata digest differs from the embedded manifest's")
        if gf.metadata_digest() != man.metadata_digest:
            problems.append("slice metadata (hyper-parameters/tokenizer) differs from the source's")
        else:
            checks.append("metadata matches source metadata digest")
        if gf.tokenizer_digest() != info.source_tokenizer_digest:
            problems.append("tokenizer metadata differs from the source's tokenizer digest")
        split_keys = [k for k in gf.keys if k.startswith(SPLIT_PREFIX)]
        if split_keys:
            problems.append(f"slice carries split-set pair {split_keys[0]!r} (llama.cpp would look for other parts)")
        # 3. range and ownership
        rng = info.range
        n_layer_kv = gf.n_layer if gf.has(f"{gf.architecture}.block_count") else None
        if n_layer_kv != info.n_layer:
            problems.append(f"slice n_layer {info.n_layer} differs from block_count {n_layer_kv}")
        range_ok = 0 <= rng.start < rng.end <= info.n_layer
        if not range_ok:
            problems.append(f"slice range {rng} is not inside [0, {info.n_layer})")
        elif info.head != rng.is_head() or info.tail != rng.is_tail(info.n_layer):
            problems.append(f"slice head/tail flags do not match range {rng}")
        if expect_range is not None and expect_range != rng:
            problems.append(f"slice covers layers {rng}, expected {expect_range}")
        adapter = ADAPTERS.get(info.arch_adapter)
        expected: list[str] = []
        if adapter is None or adapter.name != gf.architecture:
            problems.append(f"slice adapter {info.arch_adapter!r} is unknown or does not match "
                            f"architecture {gf.architecture!r} (fail closed)")
        elif adapter.version != info.arch_adapter_version:
            problems.append(f"slice was cut by {adapter.name} adapter v{info.arch_adapter_version}, "
                            f"this dgr has v{adapter.version}")
        elif range_ok:
            try:
                expected = adapter.owned([t.name for t in man.tensors], rng, info.n_layer)
            except SliceError as exc:
                problems.append(str(exc))
        have = [t.name for t in gf.tensors]
        if expected:
            missing = sorted(set(expected) - set(have))
            extra = sorted(set(have) - set(expected))
            if missing:
                problems.append(f"slice lacks {len(missing)} tensor(s) range {rng} owns, e.g. {missing[0]}")
            if extra:
                problems.append(f"slice holds {len(extra)} tensor(s) outside range {rng}, e.g. {extra[0]}")
            if sorted(e.name for e in info.entries) != sorted(expected):
                problems.append("slice tensor entries do not list exactly the tensors its range owns")
            if not missing and not extra:
                checks.append(f"tensors are exactly those range {rng} owns ({len(expected)})")
        # 4. every tensor's bytes against the manifest
        src_entries = man.by_name()
        own_entries = {e.name: e for e in info.entries}
        actual = hash_tensors(gf, [n for n in have if n in src_entries], progress=progress, label="verifying")
        bad = [a.name for a in actual if a != src_entries[a.name] or own_entries.get(a.name, a) != a]
        unknown = [n for n in have if n not in src_entries]
        if unknown:
            problems.append(f"slice holds tensor(s) not in the source manifest, e.g. {unknown[0]}")
        if bad:
            problems.append(f"{len(bad)} tensor(s) do not match the manifest (tampered or corrupt), e.g. {bad[0]}")
        elif actual:
            checks.append(f"{len(actual)} tensor hashes match the manifest")
    # 5. against the source file itself
    if source is not None:
        src_ident = identify(source, progress=progress)
        if src_ident.artifact_id != info.source_artifact_id:
            problems.append(f"slice was cut from artifact {info.source_artifact_id[:16]}…, "
                            f"but {source} is {src_ident.artifact_id[:16]}…")
        else:
            checks.append("source artifact id matches the source file")
    if problems:
        raise SliceError(f"slice {path} does not verify: " + "; ".join(problems))
    return SliceReport(str(path), rng, info.n_layer, info.source_artifact_id, len(have), tuple(checks))
