"""The route's slice cache (dgr.route.local.cached_slice, used by LocalRoute and the lab route)
reuses a cached slice only when it verifies against the manifest it carries, is a slice of the
route's artifact and covers the asked range; a slice with one altered tensor byte is refused
(named in the log) and cut again from the source. Synthetic models; seconds."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dgr.gguf.identity import identify
from dgr.gguf.slice import LayerRange, slice_gguf, verify_slice
from dgr.gguf.synth import SynthSpec, synthesize
from dgr.route.local import cached_slice
from gguf_corrupt import flip_tensor_byte


def test_cached_slice_is_verified_before_reuse(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dgr.route.local")
    src = synthesize(SynthSpec(n_layer=4, dtype="q8_0", seed=3), tmp_path / "src.gguf")
    other = synthesize(SynthSpec(n_layer=4, dtype="q8_0", seed=4), tmp_path / "other.gguf")
    aid = identify(src, progress=False, use_cache=False).artifact_id
    path = tmp_path / "cache" / "src.1-3.gguf"
    path.parent.mkdir()
    cached_slice(src, LayerRange(1, 3), path, aid)
    fresh = path.read_bytes()
    assert any("slicing layers 1:3" in line for line in caplog.messages)

    caplog.clear()
    cached_slice(src, LayerRange(1, 3), path, aid)   # a good cached slice is reused
    assert caplog.messages == [] and path.read_bytes() == fresh

    flip_tensor_byte(path, "blk.1.attn_q.weight")                                  # one altered tensor byte
    caplog.clear()
    cached_slice(src, LayerRange(1, 3), path, aid)
    assert any("refused" in line and "blk.1.attn_q.weight" in line for line in caplog.messages), caplog.messages
    assert path.read_bytes() == fresh                                   # cut again, and it verifies
    verify_slice(path, expect_range=LayerRange(1, 3), progress=False)

    slice_gguf(src, LayerRange(0, 2), path.with_name("x.gguf"), progress=False)
    path.with_name("x.gguf").replace(path)                              # another range at the path
    caplog.clear()
    cached_slice(src, LayerRange(1, 3), path, aid)
    assert any("refused" in line for line in caplog.messages) and path.read_bytes() == fresh

    slice_gguf(other, LayerRange(1, 3), path, progress=False)           # another artifact's slice
    caplog.clear()
    cached_slice(src, LayerRange(1, 3), path, aid)
    assert any("refused" in line and "not of" in line for line in caplog.messages) and path.read_bytes() == fresh
