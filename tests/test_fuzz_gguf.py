"""Seeded, bounded fuzzing of the GGUF readers (dgr.gguf: inspect, identity, recipe, slice).

A generated corpus of corrupt GGUF files (tests/gguf_corrupt.py: truncations, bit flips, huge
counts and lengths, zero, negative and overflowing dimensions, bad dimension counts, bad ggml
and value types, bad string lengths, invalid UTF-8, misaligned offsets, bad versions, stacks)
is cut from a synthetic whole model and from a slice of it. Every reader must end each file
either in a structured DgrError or in a valid result: never another exception type, never a
hang (a per-file alarm), and without allocating what a huge declared count asks for (the
traced peak allocation of each huge-size corruption stays far below it). Corruptions that no reader may accept
must end in the error. The test prints (pytest -s) and writes a JSON summary of what it tried.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest

from dgr.errors import DgrError
from dgr.gguf import identity, inspect as gguf_inspect, recipe, slice as gguf_slice
from dgr.gguf.inspect import GgufError, open_gguf
from dgr.gguf.synth import SynthSpec, synthesize

import gguf_corrupt

SEED = int(os.environ.get("DGR_FUZZ_SEED", "20261201"))
N_WHOLE = int(os.environ.get("DGR_FUZZ_GGUF_WHOLE", "900"))
N_SLICE = int(os.environ.get("DGR_FUZZ_GGUF_SLICE", "300"))
HANG_S = 20            # an input that takes this long is a hang (the usual cost is milliseconds)
PEAK_BYTES = 64 << 20  # per file; the seeds are well under 1 MiB, a honoured huge count is >= 4 GiB
# the corruptions that declare huge sizes: their allocations are traced (tracing every file is slow)
TRACED = {"huge_count", "huge_length", "huge_array", "huge_dim", "overflow_dims", "negative_dim", "length_edge", "stack"}
RUNTIME = ("0.0.0", "0" * 40, "sha256:" + "0" * 64)


class _Hang(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001
    raise _Hang()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("seeds")
    whole = synthesize(SynthSpec(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, seed=3), d / "m.gguf")
    part = d / "s.gguf"
    gguf_slice.slice_gguf(whole, gguf_slice.LayerRange(1, 2), part, progress=False)
    return {"whole": whole.read_bytes(), "slice": part.read_bytes()}


def read_everything(path: Path) -> str:
    """Every reader of dgr.gguf over one file; 'ok' or the DgrError class name."""
    try:
        with open_gguf(path) as gf:
            for t in gf.tensors:
                v = gf.tensor_bytes(t.name)
                assert v.nbytes == t.n_bytes
                del v
            for k in gf.keys:
                gf.get(k)
        gguf_inspect.inspect(path)
        identity.identify(path, progress=False, use_cache=False)
        recipe.recipe_for(path, progress=False, runtime=RUNTIME)
        with open_gguf(path) as gf:
            if gf.is_slice:
                gguf_slice.read_slice_info(gf)
        if path.name.startswith("slice"):
            gguf_slice.verify_slice(path, progress=False)
        gguf_slice.range_bytes_by_role(path, gguf_slice.LayerRange(0, 1))
        return "ok"
    except DgrError as exc:
        return type(exc).__name__


def test_seeds_read_cleanly(seeds: dict[str, bytes], tmp_path: Path) -> None:
    for name, data in seeds.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(data)
        assert read_everything(p) == "ok"
        assert gguf_corrupt.layout(data).size == len(data)


@pytest.mark.parametrize("dim", [0, 2**63, 2**64 - 1])
def test_zero_or_negative_dimension_is_refused(seeds: dict[str, bytes], tmp_path: Path, dim: int) -> None:
    data = bytearray(seeds["whole"])
    lay = gguf_corrupt.layout(bytes(data))
    f = lay.of("dim")[0]
    data[f.offset:f.offset + 8] = dim.to_bytes(8, "little")
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    want = "zero dimension" if dim == 0 else "negative as a signed 64-bit count"
    with pytest.raises(GgufError, match=want) as info:
        open_gguf(p)
    assert f"tensor '{f.owner}'" in str(info.value) and "\n" not in str(info.value)


def test_overflowing_element_count_is_refused(seeds: dict[str, bytes], tmp_path: Path) -> None:
    data = bytearray(seeds["whole"])
    lay = gguf_corrupt.layout(bytes(data))
    name = next(f.owner for f in lay.of("n_dims") if f.value == 2)
    for d in [f for f in lay.of("dim") if f.owner == name]:
        data[d.offset:d.offset + 8] = (2**33).to_bytes(8, "little")
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GgufError, match="element count .* overflows 64 bits"):
        open_gguf(p)


def test_cli_refuses_a_zero_dimension_in_one_line(seeds: dict[str, bytes], tmp_path: Path) -> None:
    data = bytearray(seeds["whole"])
    f = gguf_corrupt.layout(bytes(data)).of("dim")[0]
    data[f.offset:f.offset + 8] = bytes(8)
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "dgr.main", "gguf", "inspect", str(p)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "zero dimension" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) <= 2  # the error line (and its hint)


def test_fuzz_gguf_readers(seeds: dict[str, bytes], tmp_path: Path) -> None:
    tried, outcomes, kinds = 0, Counter(), Counter()
    refused_required = 0
    worst_peak = 0
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for seed_name, n, seed in (("whole", N_WHOLE, SEED), ("slice", N_SLICE, SEED + 1)):
            for i, c in enumerate(gguf_corrupt.corpus(seeds[seed_name], seed, n)):
                p = tmp_path / f"{seed_name}-{i}.gguf"
                p.write_bytes(c.data)
                traced = c.kind in TRACED
                if traced:
                    tracemalloc.start()
                signal.alarm(HANG_S)
                try:
                    outcome = read_everything(p)
                except _Hang:
                    pytest.fail(f"hang: {seed_name} input {i} ({c.kind}) ran {HANG_S} s (seed {seed})")
                except Exception as exc:  # noqa: BLE001 - any non-DgrError is the finding
                    keep = tmp_path.parent / f"fuzz-crash-{seed_name}-{i}.gguf"
                    keep.write_bytes(c.data)
                    pytest.fail(f"{seed_name} input {i} ({c.kind}, seed {seed}) raised "
                                f"{type(exc).__name__}: {exc} (input kept in {keep})")
                finally:
                    signal.alarm(0)
                if traced:
                    peak = tracemalloc.get_traced_memory()[1]
                    tracemalloc.stop()
                    worst_peak = max(worst_peak, peak)
                    assert peak < PEAK_BYTES, f"{seed_name} input {i} ({c.kind}) allocated {peak} bytes"
                if c.must_refuse:
                    refused_required += 1
                    assert outcome != "ok", f"{seed_name} input {i} ({c.kind}, seed {seed}) was accepted"
                p.unlink()
                tried += 1
                outcomes[outcome] += 1
                kinds[c.kind] += 1
    finally:
        tracemalloc.stop()  # no-op unless a failure left it running
        signal.signal(signal.SIGALRM, old)
    summary = {"fuzz": "gguf-python", "seed": SEED, "inputs_tried": tried, "must_refuse": refused_required,
               "outcomes": dict(outcomes), "kinds": dict(sorted(kinds.items())),
               "worst_peak_alloc_bytes": worst_peak, "crashes": 0, "hangs": 0}
    print(f"\nfuzz gguf-python: {tried} corrupt GGUF inputs tried, 0 crashes, 0 hangs; {json.dumps(summary)}")
    out = os.environ.get("DGR_FUZZ_SUMMARY_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "fuzz-gguf-python.json").write_text(json.dumps(summary) + "\n")
    assert tried >= 1000
    assert outcomes["ok"] < tried  # the corpus really is corrupt
    assert refused_required >= tried // 2


@pytest.mark.native
def test_cpp_and_python_readers_agree_on_the_corpus(seeds: dict[str, bytes], tmp_path: Path, native_bin: Path) -> None:
    """The worker's C++ header reader (gguf_fuzz_test replaying files) runs over the same
    corrupt corpus without a crash or a multi-line refusal, and opens exactly the files that
    Python's open_gguf opens (both readers enforce one format), but for ggml types newer than
    the `gguf` package."""
    files, python, unknown_type = [], [], set()
    for seed_name, n, seed in (("whole", 600, SEED + 2), ("slice", 400, SEED + 3)):
        for i, c in enumerate(gguf_corrupt.corpus(seeds[seed_name], seed, n)):
            p = tmp_path / f"{seed_name}-{i}.gguf"
            p.write_bytes(c.data)
            files.append(p)
            try:
                open_gguf(p).close()
                python.append("opened")
            except GgufError as exc:
                python.append("refused")
                if "unknown ggml type" in str(exc):
                    unknown_type.add(p.name)
    verdicts = tmp_path / "verdicts.txt"
    r = subprocess.run([str(native_bin / "gguf_fuzz_test"), *map(str, files)], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path, env={**{k: v for k, v in os.environ.items() if k != "DGR_FUZZ_SUMMARY_DIR"},
                            "DGR_FUZZ_VERDICTS": str(verdicts)})  # a replay: leaves the fuzz summary alone
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"fuzz gguf: {len(files)} inputs tried" in r.stdout
    cpp = verdicts.read_text().split()
    # the one known difference: a ggml type newer than the `gguf` package (Q2_0 = 42 at the pin,
    # gguf 0.19.0 stops at 41) is refused by Python (fail closed) and read by the worker, whose
    # type table is ggml's own
    skew = {f.name for f, py, c in zip(files, python, cpp) if (py, c) == ("refused", "opened") and f.name in unknown_type}
    differ = [(f.name, py, c) for f, py, c in zip(files, python, cpp) if py != c and f.name not in skew]
    assert len(cpp) == len(files) and not differ, differ[:5]
    assert 0 < python.count("opened") < len(files)
    print(f"\nfuzz gguf-cpp-vs-python: {len(files)} corrupt files, {python.count('opened')} opened by both, "
          f"{python.count('refused') - len(skew)} refused by both, {len(skew)} with a ggml type only the worker knows")
