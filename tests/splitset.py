"""Test helpers: write split GGUF sets the way the pinned llama-gguf-split does, and find the tool.

``split_like_gguf_split`` mirrors tools/gguf-split/gguf-split.cpp at the pin: part 1 gets every
metadata pair of the source (copied byte for byte) followed by ``split.no``, ``split.count``,
``split.tensors.count``; every other part only those three; tensors in file order,
``max_tensors`` per part. Used where the built binary is not needed, so the default lane runs
without a native build.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dgr.gguf.gguf_set import part_name
from dgr.gguf.inspect import DEFAULT_ALIGNMENT, open_gguf
from dgr.gguf.slice import _RawValue, _writer_class

REPO = Path(__file__).resolve().parent.parent


def split_like_gguf_split(src: Path, prefix: Path, max_tensors: int, *,
                          part_extra_kv: dict[int, dict[str, Any]] | None = None) -> list[Path]:
    """Split ``src`` into ``prefix``-0000k-of-0000N.gguf; ``part_extra_kv`` adds string pairs to
    a part (0-based), to make broken sets."""
    import gguf

    out: list[Path] = []
    with open_gguf(src) as gf:
        names = [t.name for t in gf.tensors]
        groups = [names[i:i + max_tensors] for i in range(0, len(names), max_tensors)]
        n = len(groups)
        for i, group in enumerate(groups):
            path = prefix.with_name(part_name(prefix.name, i + 1, n))
            w = _writer_class()(path, gf.architecture)
            if i == 0:
                w.data_alignment = gf.alignment
                for key in gf.keys:
                    if key != "general.architecture":
                        w.add_key_value(key, _RawValue(gf.kv_value_bytes(key)), gguf.GGUFValueType.STRING)
            else:
                w.data_alignment = DEFAULT_ALIGNMENT
                w.kv_data[0].pop("general.architecture", None)
            w.add_uint16("split.no", i)
            w.add_uint16("split.count", n)
            w.add_int32("split.tensors.count", len(names))
            for key, value in ((part_extra_kv or {}).get(i) or {}).items():
                w.add_string(key, value)
            for name in group:
                t = gf.tensor(name)
                w.add_tensor_info(name, t.byte_shape, np.dtype(np.uint8), t.n_bytes,
                                  gguf.GGMLQuantizationType(t.ggml_type))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for name in group:
                w.write_tensor_data(gf.tensor_bytes(name).reshape(gf.tensor(name).byte_shape))
            w.close()
            out.append(path)
    return out


def gguf_split_tool() -> Path:
    """build/cpu/bin/llama-gguf-split (`dgr build --tools`); a skip without it, a failure in CI."""
    exe = REPO / "build" / "cpu" / "bin" / "llama-gguf-split"
    if not exe.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail("build/cpu/bin/llama-gguf-split missing in CI: the test command must build --tools first")
        pytest.skip("build/cpu/bin/llama-gguf-split missing: run `dgr build --target llama-gguf-split`")
    return exe


def run_gguf_split(exe: Path, *args: str) -> None:
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"llama-gguf-split {' '.join(args)} failed: {r.stderr[-2000:]}"
