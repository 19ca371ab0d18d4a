"""Shard memory and parity measurements through the native ``dgr-parity`` program.

``dgr-parity --memory --range A:B`` loads one layer range in a fresh process, decodes a short
prompt (so the weights it uses are touched) and reports, from /proc/self/status and
/proc/self/smaps, its RSS (anonymous and file-backed), the bytes of the model file it maps and
how much of that is resident, and the KV cache it allocated (cells x owned layers). Each range is
measured in its own process so that numbers never mix. ``dgr-parity --split ...`` runs the whole
model and the chained ranges in one process and compares them (see docs/patches.md).

Ownership is recomputed here from the GGUF (independently of the C++ loader) so that a test can
check that a shard allocates exactly the tensors its range owns.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DgrError

_BLK = re.compile(r"^blk\.(\d+)\.")
HEAD_TENSORS = frozenset({"token_embd.weight"})
TAIL_TENSORS = frozenset({"output_norm.weight", "output.weight"})
SHARED_TENSORS = frozenset({"rope_freqs.weight"})


class ProbeError(DgrError):
    """dgr-parity failed or printed something that is not its JSON report."""


@dataclass(frozen=True)
class ShardSpec:
    start: int
    end: int
    path: Path  # full GGUF or slice file

    @property
    def label(self) -> str:
        return f"{self.start}:{self.end}"


def owned_tensors(path: Path, start: int, end: int) -> tuple[list[str], int, int]:
    """(names, bytes, n_layer) of the tensors the dense-llama range [start, end) holds in ``path``:
    its blk.N tensors, the token embedding for a head, the final norm and output for a tail
    (the token embedding when the output is tied), and rope_freqs for everyone."""
    from ..gguf.gguf_set import open_model

    with open_model(path) as gf:  # the strict reader (every part of a split set): a corrupt file is a GgufError
        n_layer = gf.get("llama.block_count")
        if not isinstance(n_layer, int) or isinstance(n_layer, bool) or n_layer <= 0:
            raise ProbeError(f"{path} is not a llama GGUF (no valid llama.block_count)")
        names = {t.name: t.n_bytes for t in gf.tensors}
    tied = "output.weight" not in names
    head, tail = start == 0, end == n_layer
    owned = []
    for name in names:
        m = _BLK.match(name)
        if m:
            keep = start <= int(m.group(1)) < end
        elif name in HEAD_TENSORS:
            keep = head or (tied and tail)
        elif name in TAIL_TENSORS:
            keep = tail
        else:
            keep = name in SHARED_TENSORS
        if keep:
            owned.append(name)
    return sorted(owned), sum(names[n] for n in owned), n_layer


def parse_report(stdout: str, stderr: str = "", name: str = "dgr-parity") -> dict[str, Any]:
    """The JSON report dgr-parity prints as its last stdout line."""
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ProbeError(f"{name} printed no JSON report: {stderr.strip()[-500:]}") from None


def _run_json(cmd: list[str], timeout: float) -> dict[str, Any]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode not in (0, 1):
        raise ProbeError(f"{Path(cmd[0]).name} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return parse_report(proc.stdout, proc.stderr, Path(cmd[0]).name)


def memory_command(parity_bin: Path, shard: ShardSpec, *, n_ctx: int = 2048, mmap: bool = True,
                   threads: int = 2) -> list[str]:
    cmd = [str(parity_bin), "--model", str(shard.path), "--memory", "--range", shard.label,
           "--n-ctx", str(n_ctx), "--threads", str(threads)]
    if not mmap:
        cmd.append("--no-mmap")
    return cmd


def probe(parity_bin: Path, shard: ShardSpec, *, n_ctx: int = 2048, mmap: bool = True,
          threads: int = 2, timeout: float = 600) -> dict[str, Any]:
    """Memory report of one shard, measured in its own process."""
    return _run_json(memory_command(parity_bin, shard, n_ctx=n_ctx, mmap=mmap, threads=threads), timeout)


def parity_command(parity_bin: Path, model: Path, splits: list[str], *, prompt: str | None = None,
                   tokens: list[int] | None = None, n_random: int = 0, n_predict: int = 32,
                   slices: list[Path] | None = None, threads: int = 2, n_seq: int = 1,
                   kv_per_seq: bool = False, extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [str(parity_bin), "--model", str(model), "--n-predict", str(n_predict), "--threads", str(threads)]
    if n_seq > 1:
        cmd += ["--n-seq", str(n_seq)] + (["--kv-per-seq"] if kv_per_seq else [])
    cmd += list(extra)
    for s in splits:
        cmd += ["--split", s]
    if slices:
        cmd += ["--slices", ",".join(str(p) for p in slices)]
    if prompt is not None:
        cmd += ["--prompt", prompt]
    elif tokens:
        cmd += ["--tokens", ",".join(str(t) for t in tokens)]
    else:
        cmd += ["--n-random", str(max(1, n_random))]
    return cmd


def parity(parity_bin: Path, model: Path, splits: list[str], *, timeout: float = 1800,
           **kwargs: Any) -> dict[str, Any]:
    """Run whole vs split parity (see parity_command); returns dgr-parity's JSON report."""
    return _run_json(parity_command(parity_bin, model, splits, **kwargs), timeout)


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers a reader compares: RSS after decode, mapped/resident model bytes, KV bytes."""
    after = report["after_decode"]
    return {
        "range": report["range"], "head": report["head"], "tail": report["tail"],
        "mmap": report["mmap"],
        "rss_bytes": after["vm_rss_bytes"], "rss_anon_bytes": after["rss_anon_bytes"],
        "rss_file_bytes": after["rss_file_bytes"],
        "model_mapped_bytes": after["model_mapped_bytes"],
        "model_mapped_resident_bytes": after["model_mapped_resident_bytes"],
        "model_buffer_mib_logged": report.get("model_buffer_mib_logged"),
        "kv_bytes": report["kv"]["kv_bytes"], "kv_layers": report["kv"]["kv_layers"],
        "kv_cells": report["kv"]["kv_cells"], "token_input": report.get("token_input"),
    }
