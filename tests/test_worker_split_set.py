"""A split GGUF set (PREFIX-00001-of-0000N.gguf …) in the worker (common/identity.cpp GgufSet,
docs/identity.md "Split GGUF sets"): given part 1, the worker proves the identity of every part
(the set has the artifact id of the same model in one file), loads it whole and by range with
the same greedy tokens as the single file, and after loading keeps mapped only the parts its
range holds tensors of. A changed byte in any part changes the id it serves; a missing, extra,
reordered or foreign part, or part 2 given as the model, is refused at start, naming the part."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dgr.gguf import identity
from dgr.gguf.synth import SynthSpec, synthesize
from dgr.protocol.client import WorkerClient, boundary_rows, sampled
from dgr.route.supervisor import WorkerProcess
from dgr.shard.v1 import shard_runtime_pb2 as pb
from gguf_corrupt import flip_tensor_byte
from splitset import gguf_split_tool, run_gguf_split, split_like_gguf_split

pytestmark = pytest.mark.native

ARGS = ["--max-sessions", "2", "--ctx-per-session", "256", "--threads", "1"]
PROMPT = "once upon a time"


def split_gguf(src: Path, prefix: Path, n_parts: int) -> list[Path]:
    """``src`` cut into ``n_parts`` parts the way the pinned llama-gguf-split lays them out."""
    from gguf import GGUFReader
    n = len(GGUFReader(src).tensors)
    parts = split_like_gguf_split(src, prefix, -(-n // n_parts))
    assert len(parts) == n_parts
    return parts


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, list[Path]]:
    d = tmp_path_factory.mktemp("split")
    single = synthesize(SynthSpec(n_layer=4, dtype="q8_0", seed=11), d / "m.gguf")
    (d / "set").mkdir()
    return single, split_gguf(single, d / "set" / "m", 3)


def greedy(c: WorkerClient, n: int = 8) -> list[int]:
    ids = c.tokenize(PROMPT, add_special=True)
    out: list[int] = []
    with c.open_session() as s:
        r = s.prefill_chunk(ids)
        for k in range(n):
            out.append(sampled(r))
            if k + 1 < n:
                r = s.decode_step(out[-1])
    return out


def two_shards(bin_: Path, model: Path, mid: int, n_layer: int, n: int = 8) -> tuple[list[int], list[str]]:
    with WorkerProcess.start(["--model", str(model), *ARGS, "--layers", f"0:{mid}"], binary=bin_) as hw, \
            WorkerProcess.start(["--model", str(model), *ARGS, "--layers", f"{mid}:{n_layer}"], binary=bin_) as tw:
        h, t = hw.client(timeout=60), tw.client(timeout=60)
        n_embd = h.capability().identity.n_embd
        ids = h.tokenize(PROMPT, add_special=True)
        hs, ts = h.open_session("s"), t.open_session("s")
        out = [sampled(ts.prefill_chunk(rows=boundary_rows(hs.prefill_chunk(ids, sample=False), n_embd)))]
        for _ in range(n - 1):
            r = hs.exchange(hs._input_frame(pb.PHASE_DECODE, [out[-1]], None, False))
            hs._applied(r)
            r = ts.exchange(ts._input_frame(pb.PHASE_DECODE, None, boundary_rows(r, n_embd), True))
            ts._applied(r)
            out.append(sampled(r))
        hs.close()
        ts.close()
        return out, [*hw.stderr_lines, *tw.stderr_lines]


def refused(bin_: Path, model: Path, *extra: str) -> str:
    r = subprocess.run([str(bin_ / "dgr-worker"), "serve", "--listen", "127.0.0.1:0", "--model", str(model), *ARGS,
                        *extra], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    errs = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errs) == 1 and "refusing to serve" in errs[0], r.stderr
    return errs[0]


def test_split_set_serves_the_single_file_identity_and_tokens(native_bin: Path, models) -> None:
    single, parts = models
    bin_ = native_bin / "dgr-worker"
    want = identity.identify(single, progress=False, use_cache=False).artifact_id
    with WorkerProcess.start(["--model", str(single), *ARGS], binary=bin_) as w:
        c = w.client(timeout=60)
        alone = greedy(c)
        single_fp = c.capability().identity.compatibility_fingerprint
    with WorkerProcess.start(["--model", str(parts[0]), *ARGS], binary=bin_) as w:
        c = w.client(timeout=60)
        ident = c.capability().identity
        assert ident.artifact_id == want and ident.compatibility_fingerprint == single_fp
        assert greedy(c) == alone
        assert any("3-part split set" in ln for ln in w.stderr_lines), list(w.stderr_lines)
    # by range: a head and a tail over the set give the single file's tokens
    got, _ = two_shards(bin_, parts[0], 2, 4)
    assert got == alone


def smaps_by_file(pid: int, files: list[Path]) -> dict[int, tuple[int, int]]:
    """{part index: (bytes mapped, bytes resident)} over the process's mappings of `files`."""
    out: dict[int, tuple[int, int]] = {}
    cur = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
            cur = next((i for i, f in enumerate(files) if len(head) >= 6 and head[5] == str(f)), None)
            if cur is not None:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                m, r = out.get(cur, (0, 0))
                out[cur] = (m + hi - lo, r)
        elif cur is not None and head[0] == "Rss:":
            m, r = out[cur]
            out[cur] = (m, r + int(head[1]) * 1024)
    return out


def test_a_range_reads_only_its_parts(native_bin: Path, models) -> None:
    """After loading, a range's worker keeps mapped only the parts that hold its tensors, and
    not one page of the other parts is resident: llama.cpp maps every part without prefetch
    while loading (the range is partial), touches only the range's tensors, and then unmaps what
    it does not use -- all of a part it holds no tensor of but the last partial page, which
    llama_mmap::unmap_fragment rounds away and which is never touched (measured: 0 bytes
    resident)."""
    _, parts = models
    from gguf import GGUFReader
    owners = {t.name: i for i, p in enumerate(parts) for t in GGUFReader(p).tensors}
    head_parts = {owners[n] for n in owners if n.startswith(("blk.0.", "token_embd"))}
    assert len(head_parts) < len(parts)
    page = 4096
    with WorkerProcess.start(["--model", str(parts[0]), *ARGS, "--layers", "0:1"], binary=native_bin / "dgr-worker") as w:
        c = w.client()
        with c.open_session() as s:  # compute once: the range's pages are touched
            s.prefill_chunk(c.tokenize(PROMPT, add_special=True), sample=False)
        seen = smaps_by_file(w.pid, parts)
    for i in range(len(parts)):
        mapped, resident = seen.get(i, (0, 0))
        if i in head_parts:
            assert resident > 0, (i, seen)
        else:
            assert mapped <= page and resident == 0, (i, seen)


@pytest.mark.parametrize("part", [0, 1, 2])
def test_a_changed_byte_in_any_part_changes_the_served_id(native_bin: Path, models, tmp_path: Path, part: int) -> None:
    single, parts = models
    want = identity.identify(single, progress=False, use_cache=False).artifact_id
    d = tmp_path / "set"
    d.mkdir()
    copies = [Path(shutil.copy(p, d / p.name)) for p in parts]
    from gguf import GGUFReader
    name = GGUFReader(copies[part]).tensors[-1].name
    flip_tensor_byte(copies[part], name)
    with WorkerProcess.start(["--model", str(copies[0]), *ARGS], binary=native_bin / "dgr-worker") as w:
        got = w.client().capability().identity.artifact_id
    assert got != want
    err = refused(native_bin, copies[0], "--artifact-id", want)
    assert "--artifact-id" in err and want in err and got in err


def test_broken_sets_are_refused_naming_the_part(native_bin: Path, models, tmp_path: Path) -> None:
    single, parts = models
    d = tmp_path / "set"
    d.mkdir()
    copies = [Path(shutil.copy(p, d / p.name)) for p in parts]
    # part 2 names the set too: served from part 1, with the set's identity
    want = identity.identify(single, progress=False, use_cache=False).artifact_id
    with WorkerProcess.start(["--model", str(copies[1]), *ARGS], binary=native_bin / "dgr-worker") as w:
        assert w.client().capability().identity.artifact_id == want
    # a part renamed out of the pattern
    odd = d / "renamed.gguf"
    shutil.copy(copies[1], odd)
    err = refused(native_bin, odd)
    assert str(odd) in err and "must be named" in err
    odd.unlink()
    # a missing part
    copies[2].rename(d / "hidden")
    err = refused(native_bin, copies[0])
    assert "part 3 of 3" in err and str(copies[2]) in err and "missing" in err
    # reordered parts: 2 and 3 swapped
    (d / "hidden").rename(copies[1].with_suffix(".tmp"))
    copies[1].rename(copies[2])
    copies[1].with_suffix(".tmp").rename(copies[1])
    err = refused(native_bin, copies[0])
    assert str(copies[1]) in err and "reordered" in err
    copies[1].rename(d / "x")
    copies[2].rename(copies[1])
    (d / "x").rename(copies[2])
    # an extra part next to the set
    extra = d / "m-00004-of-00004.gguf"
    shutil.copy(copies[2], extra)
    err = refused(native_bin, copies[0])
    assert "extra part" in err and str(extra) in err
    extra.unlink()
    # a part of another set (another model cut the same way)
    other = synthesize(SynthSpec(n_layer=4, dtype="q8_0", seed=12), tmp_path / "o.gguf")
    (tmp_path / "oset").mkdir()
    oparts = split_gguf(other, tmp_path / "oset" / "m", 3)
    shutil.copy(oparts[1], copies[1])
    r = subprocess.run([str(native_bin / "dgr-worker"), "serve", "--listen", "127.0.0.1:0", "--model", str(copies[0]),
                        *ARGS, "--artifact-id", identity.identify(single, progress=False, use_cache=False).artifact_id],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--artifact-id" in r.stderr  # same layout, other bytes: another id
    # a part with a different count is a mismatch
    oparts4 = split_gguf(other, tmp_path / "oset" / "q", 4)
    shutil.copy(oparts4[1], copies[1])
    err = refused(native_bin, copies[0])
    assert str(copies[1]) in err and "split.count 4" in err


@pytest.mark.real
def test_smollm2_cut_by_the_pinned_gguf_split_runs_like_the_file(native_bin: Path, smollm2_path: Path,
                                                                 tmp_path: Path) -> None:
    """SmolLM2 split into 3 parts by the pinned llama-gguf-split: the worker serves the file's
    identity, and whole and by range the same greedy tokens and the same logits (top
    log-probabilities) as the single file."""
    from dgr.protocol.client import Sampling
    exe = gguf_split_tool()
    (tmp_path / "set").mkdir()
    run_gguf_split(exe, "--split-max-tensors", "100", str(smollm2_path), str(tmp_path / "set" / "smol"))
    parts = sorted((tmp_path / "set").glob("smol-*-of-*.gguf"))
    assert len(parts) == 3, parts
    bin_ = native_bin / "dgr-worker"
    args = ["--max-sessions", "1", "--ctx-per-session", "256", "--threads", "2"]

    def run(model: Path, *extra: str) -> tuple[str, list[int], list[list[tuple[int, float]]]]:
        with WorkerProcess.start(["--model", str(model), *args, *extra], binary=bin_, ready_timeout=120) as w:
            c = w.client(timeout=120)
            ident = c.capability().identity.artifact_id
            ids = c.tokenize(PROMPT, add_special=True)
            toks, tops = [], []
            with c.open_session(sampling=Sampling(top_logprobs=4, ignore_eog=True)) as s:
                r = s.prefill_chunk(ids)
                for k in range(12):
                    t = r.tail.tokens[0]
                    toks.append(t.token_id)
                    tops.append([(x.token_id, x.logprob) for x in t.top_logprobs])
                    if k + 1 < 12:
                        r = s.decode_step(t.token_id)
            return ident, toks, tops

    want = run(smollm2_path)
    got = run(parts[0])
    assert got == want  # identity, tokens and log-probabilities bit for bit
    # by range over the set: the head and tail give the file's tokens
    toks, _ = two_shards(bin_, parts[0], 15, 30, 12)
    assert toks == want[1]
