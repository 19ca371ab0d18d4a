"""llama.cpp's own RPC split as a yardstick for a dgr route: the same model split over two local
``rpc-server`` processes (llama.cpp's GGML_RPC backend), measured with an RPC-enabled
``llama-bench`` from build/<backend>-rpc/ (``dgr.upstream.build.build_rpc_tools``).

Layer placement at the pin (src/llama-model.cpp, ``load_tensors``): with ``-ngl`` >= n_layer + 1
every repeating layer *and* the output layer ("layer" n_layer) are offloaded; layer ``il`` goes to
the first device whose cumulative normalized tensor split is > il / (n_layer + 1); the input
(token embedding) always stays on the local CPU of the llama-bench process. So a route split
``0:15 | 15:30`` is ``-ts 15/16``: the second server also takes the output head, as the last
dgr shard does. ``-dev RPC0/RPC1`` keeps the local CPU (and any local GPU) from taking layers;
each server is started with ``-d CPU``, so no GPU is used on either side.

``measure_rpc`` never raises for a lane that cannot run (not built, a server that does not come
up, llama-bench failing): it returns ``{"skipped": True, "reason": ...}``. Only a missing model
file is a ``DgrError``.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from .. import childproc
from ..errors import DgrError
from .llama_tools import parse_llama_bench, run_measured

_log = logging.getLogger(__name__)

HOST = "127.0.0.1"
Split = Sequence[tuple[int, int]]


# --- pure helpers (unit-tested) ------------------------------------------------------------------

def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def check_split(split: Split) -> int:
    """Validate a route split (contiguous, from layer 0, non-empty shards); return n_layer."""
    if len(split) < 1:
        raise ValueError("empty split")
    prev = 0
    for a, b in split:
        if a != prev or b <= a:
            raise ValueError(f"split {','.join(f'{x}:{y}' for x, y in split)} is not contiguous from layer 0 "
                             "with non-empty shards")
        prev = b
    return prev


def tensor_split_for(split: Split) -> tuple[int, ...]:
    """llama.cpp ``-ts`` weights that put exactly the layers of each route shard on one RPC
    device: the layer counts, the last shard + 1 for the output layer (see the module doc)."""
    check_split(split)
    w = [b - a for a, b in split]
    w[-1] += 1
    return tuple(w)


def format_tensor_split(ts: Sequence[float]) -> str:
    return "/".join(str(int(x)) if float(x).is_integer() else repr(float(x)) for x in ts)


def assign_layers(ts: Sequence[float], n_layer: int, n_gpu_layers: int | None = None) -> list[int | None]:
    """The device index llama.cpp gives to layers 0..n_layer (the last entry is the output layer)
    for tensor split ``ts`` and ``-ngl`` (default: all) in float32 arithmetic as at the pin;
    None: the local CPU."""
    if n_gpu_layers is None:
        n_gpu_layers = n_layer + 1
    n_dev = len(ts)
    splits, acc = [], 0.0
    for x in ts:
        acc = _f32(acc + _f32(x))
        splits.append(acc)
    total = splits[-1]
    splits = [_f32(s / total) for s in splits]
    i_gpu_start = max(n_layer + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer + 1)
    out: list[int | None] = []
    for il in range(n_layer + 1):
        if il < i_gpu_start or il - i_gpu_start >= act:
            out.append(None)
            continue
        x = _f32(float(il - i_gpu_start) / act)
        out.append(next((i for i, s in enumerate(splits) if s > x), n_dev))  # std::upper_bound
    return out


def layer_ranges(assignment: Sequence[int | None], n_dev: int) -> list[list[tuple[int, int]]]:
    """Per device, the contiguous [a, b) ranges of repeating layers it holds (output excluded)."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(n_dev)]
    for il, d in enumerate(assignment[:-1]):
        if d is None or d >= n_dev:
            continue
        r = out[d]
        if r and r[-1][1] == il:
            r[-1] = (r[-1][0], il + 1)
        else:
            r.append((il, il + 1))
    return out


def ngl_for(n_layer: int) -> int:
    """-ngl that offloads every repeating layer and the output layer."""
    return max(99, n_layer + 1)


def server_command(exe: Path | str, port: int, threads: int) -> list[str]:
    """One rpc-server on loopback, CPU device only (never a GPU), no local tensor cache (-c only
    speeds up re-loading the same weights and writes under ~/.cache)."""
    return [str(exe), "-H", HOST, "-p", str(port), "-t", str(threads), "-d", "CPU"]


def bench_command(exe: Path | str, model: Path | str, servers: Sequence[str], ts: Sequence[float], *,
                  threads: int, n_prompt: int, n_gen: int, repeats: int, n_layer: int = 0,
                  verbose: bool = True) -> list[str]:
    """The llama-bench command line. ``--rpc`` must precede ``-dev``: llama-bench resolves device
    names while parsing, and RPC devices are named RPC0, RPC1, … in registration order."""
    ngl = ngl_for(n_layer)
    cmd = [str(exe), "-m", str(model), "--rpc", ",".join(servers),
           "-dev", "/".join(f"RPC{i}" for i in range(len(servers))),
           "-ngl", str(ngl), "-sm", "layer", "-ts", format_tensor_split(ts),
           "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads), "-r", str(repeats), "-o", "json"]
    if verbose:
        cmd.append("-v")   # load log on stderr: which device got which layer, buffer sizes
    return cmd


_ASSIGN_RE = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")
_BUF_RE = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")


def parse_load_log(stderr: str) -> dict[str, Any]:
    """From llama-bench -v stderr: {device name: [layer, …]} and {buffer name: MiB}."""
    layers: dict[str, list[int]] = {}
    for m in _ASSIGN_RE.finditer(stderr):
        il, dev = int(m.group(1)), m.group(2)
        if il not in layers.setdefault(dev, []):
            layers[dev].append(il)
    bufs: dict[str, float] = {}
    for m in _BUF_RE.finditer(stderr):
        bufs.setdefault(m.group(1), float(m.group(2)))
    return {"layers_by_device": layers, "model_buffer_mib": bufs}


def _ranges(layers: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for il in sorted(set(layers)):
        if out and out[-1][1] == il:
            out[-1] = (out[-1][0], il + 1)
        else:
            out.append((il, il + 1))
    return out


def check_placement(load: dict[str, Any], split: Split, endpoints: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Per server: the repeating layers llama-bench put on it (RPC<i> is the i-th server), whether
    it holds the output layer, its model buffer; warnings for a server that got nothing, a
    placement that differs from the route split, or layers left on a local device."""
    n_layer = split[-1][1]
    by_dev: dict[str, list[int]] = load.get("layers_by_device", {})
    bufs: dict[str, float] = load.get("model_buffer_mib", {})
    have_log = bool(by_dev or bufs)
    per_server, warnings = [], []
    for i, ((a, b), ep) in enumerate(zip(split, endpoints)):
        dev = f"RPC{i}"
        got = by_dev.get(dev, [])
        reps = _ranges([il for il in got if il < n_layer])
        mib = next((v for k, v in bufs.items() if k.endswith(f"[{ep}]")), None)
        per_server.append({"endpoint": ep, "device": dev, "expected_layers": f"{a}:{b}",
                           "layers": [f"{x}:{y}" for x, y in reps], "output_layer": n_layer in got,
                           "model_buffer_mib": mib})
        if not have_log:
            continue
        if not reps and not mib:
            warnings.append(f"rpc-server {ep} ({dev}) got no layers")
        elif by_dev and reps != [(a, b)]:
            warnings.append(f"rpc-server {ep} ({dev}) got layers "
                            f"{','.join(f'{x}:{y}' for x, y in reps) or 'none'}, the route shard is {a}:{b}")
    if not have_log:
        warnings.append("llama-bench -v printed no load log: which server got which layers is unverified")
    local = sorted(d for d, ls in by_dev.items() if ls and not re.fullmatch(r"RPC\d+", d))
    if local:
        warnings.append(f"layers also placed on local device(s) {', '.join(local)}")
    return per_server, warnings


def parse_bench_json(stdout: str) -> dict[str, Any]:
    """pp/tg from the typed rows (:func:`dgr.bench.llama_tools.parse_llama_bench`), and how
    llama-bench placed the model (devices, split) from its first raw row."""
    typed = parse_llama_bench(stdout)
    pp = next((r for r in typed if r.is_prefill), None)
    tg = next((r for r in typed if r.is_decode), None)
    rows = json.loads(stdout[stdout.index("["):])
    first = rows[0] if rows else {}
    return {
        "pp_tok_s": pp.avg_ts if pp else None, "tg_tok_s": tg.avg_ts if tg else None,
        "pp_stddev": pp.stddev_ts if pp else None, "tg_stddev": tg.stddev_ts if tg else None,
        "devices": first.get("devices"), "backends": first.get("backends"),
        "bench_tensor_split": first.get("tensor_split"), "n_gpu_layers": first.get("n_gpu_layers"),
        "split_mode": first.get("split_mode"), "n_threads": first.get("n_threads"),
    }


# --- processes --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True   # the server serves this probe and drops it (no HELLO sent)
    except OSError:
        return False


class _Server:
    def __init__(self, exe: Path, threads: int, logdir: Path, idx: int) -> None:
        self.exe, self.threads, self.logdir, self.idx = exe, threads, logdir, idx
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.log = logdir / f"rpc-server-{idx}.log"

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self, deadline_s: float = 60.0, attempts: int = 3) -> None:
        last = ""
        for _ in range(attempts):
            self.port = _free_port()
            with open(self.log, "wb") as out:
                self.proc = childproc.popen(
                    server_command(self.exe, self.port, self.threads), stdin=subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT)
            t_end = time.monotonic() + deadline_s
            while time.monotonic() < t_end:
                if self.proc.poll() is not None:
                    break
                if _accepting(self.port):
                    return
                time.sleep(0.1)
            last = self.tail()
            code = self.proc.poll()
            self.stop()
            if code is None:
                raise RuntimeError(f"rpc-server {self.idx} did not accept connections on {self.endpoint} "
                                   f"within {deadline_s:.0f}s; log: {last}")
        raise RuntimeError(f"rpc-server {self.idx} exited at start ({attempts} tries); log: {last}")

    def devices(self) -> list[str]:
        """The devices the server reported at start ("CPU: <cpu model> (… MiB …)")."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        m = re.search(r"^Devices:\n((?:  \S.*\n)+)", text, re.M)
        return [ln.strip() for ln in m.group(1).splitlines() if not ln.strip().startswith("transport")] if m else []

    def tail(self, n: int = 600) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:].strip().replace("\n", " | ")
        except OSError:
            return ""

    def stop(self) -> int | None:
        p, self.proc = self.proc, None
        if p is None:
            return None
        from ..route.supervisor import stop_child

        return stop_child(p, 5)


def _skip(reason: str, **extra: Any) -> dict[str, Any]:
    return {"skipped": True, "reason": reason, **extra}


def measure_rpc(model: Path, *, threads: int, n_prompt: int, n_gen: int, repeats: int = 1,
                backend: str = "cpu", split: tuple[tuple[int, int], ...] = ((0, 15), (15, 30)),
                build_missing: bool = True,
                timeout_s: float = 1800.0) -> dict[str, Any]:
    """llama-bench pp/tg over ``len(split)`` local rpc-servers, layers placed as ``split``.

    Returns ``{"skipped": False, "command", "pp_tok_s", "tg_tok_s", "pp_stddev", "tg_stddev",
    "servers", "tensor_split", "devices", …, "warnings"}`` or ``{"skipped": True, "reason"}``.
    """
    say = _log.info
    model = Path(model)
    if not model.is_file():
        raise DgrError(f"model file {model} not found")
    try:
        n_layer = check_split(split)
    except ValueError as exc:
        return _skip(f"invalid split: {exc}")
    warnings: list[str] = []
    try:
        from ..gguf.inspect import open_gguf

        with open_gguf(model) as gf:
            model_layers = int(gf.n_layer)
    except Exception as exc:  # noqa: BLE001 - an unreadable header is llama-bench's to report
        model_layers = None
        warnings.append(f"could not read n_layer from the GGUF header: {exc}")
    if model_layers is not None and model_layers != n_layer:
        return _skip(f"split ends at layer {n_layer}; the model has {model_layers} layers")

    from ..upstream.build import rpc_tool_binary

    try:
        if build_missing:
            say(f"building llama.cpp RPC tools (build/{backend}-rpc, GGML_RPC=ON)")
        server_exe = rpc_tool_binary("rpc-server", backend, build_missing=build_missing)
        bench_exe = rpc_tool_binary("llama-bench", backend, build_missing=False)
    except DgrError as exc:
        return _skip(f"llama.cpp RPC tools unavailable: {exc.one_line()}")
    except Exception as exc:  # noqa: BLE001 - e.g. a compiler crash surfaced differently
        return _skip(f"building the llama.cpp RPC tools failed: {type(exc).__name__}: {exc}")
    for exe in (server_exe, bench_exe):
        if not exe.is_file():
            return _skip(f"llama.cpp RPC tools unavailable: {exe} missing")

    ts = tensor_split_for(split)
    expected = layer_ranges(assign_layers(ts, n_layer, ngl_for(n_layer)), len(split))
    if [[(a, b)] for a, b in split] != expected:   # cannot happen at the pin; guards a change there
        warnings.append(f"-ts {format_tensor_split(ts)} places layers as {expected}, not as the split {list(split)}")

    with tempfile.TemporaryDirectory(prefix="dgr-rpc-") as tmp:
        servers = [_Server(server_exe, threads, Path(tmp), i) for i in range(len(split))]
        try:
            say(f"starting {len(servers)} rpc-servers ({threads} threads each, CPU device)")
            try:
                for s in servers:
                    s.start()
            except (RuntimeError, OSError) as exc:
                return _skip(f"could not start the rpc-servers: {exc}")
            endpoints = [s.endpoint for s in servers]
            server_cmds = [shlex.join(server_command(server_exe, s.port, threads)) for s in servers]
            cmd = bench_command(bench_exe, model, endpoints, ts, threads=threads, n_prompt=n_prompt,
                                n_gen=n_gen, repeats=repeats, n_layer=n_layer)
            say("llama-bench over RPC: " + shlex.join(cmd))
            try:
                p = run_measured(cmd, timeout=timeout_s)
            except DgrError as exc:
                return _skip(f"could not run llama-bench: {exc.one_line()}", command=shlex.join(cmd))
            if p.timed_out:
                return _skip(f"llama-bench over RPC timed out after {timeout_s:.0f}s", command=shlex.join(cmd))
            wall = p.wall_seconds
            dead = [f"rpc-server {s.idx} ({s.endpoint}) exited with {s.proc.returncode}: {s.tail()}"
                    for s in servers if s.proc is not None and s.proc.poll() is not None]
            if p.returncode != 0:
                err = "\n".join(ln for ln in p.stderr.splitlines() if ln.strip())[-400:]
                return _skip(f"llama-bench over RPC failed (exit {p.returncode}): {err}"
                             + (f"; {'; '.join(dead)}" if dead else ""), command=shlex.join(cmd))
            try:
                res = parse_bench_json(p.stdout)
            except (DgrError, ValueError, KeyError, TypeError, IndexError) as exc:
                return _skip(f"llama-bench over RPC printed no readable JSON ({exc}): {p.stdout[-300:]!r}",
                             command=shlex.join(cmd))
            warnings += dead
        finally:
            for s in servers:
                s.stop()
        server_devices = {s.endpoint: s.devices() for s in servers}
    for ep, devs in server_devices.items():
        if any(not d.startswith("CPU:") for d in devs):
            warnings.append(f"rpc-server {ep} reported non-CPU device(s): {'; '.join(devs)}")

    load = parse_load_log(p.stderr)
    per_server, placement_warnings = check_placement(load, split, endpoints)
    warnings += placement_warnings
    if (res["pp_tok_s"] is None and n_prompt > 0) or (res["tg_tok_s"] is None and n_gen > 0):
        warnings.append("llama-bench reported no pp or tg row")
    return {
        "skipped": False, "command": shlex.join(cmd),
        "pp_tok_s": res["pp_tok_s"], "tg_tok_s": res["tg_tok_s"],
        "pp_stddev": res["pp_stddev"], "tg_stddev": res["tg_stddev"],
        "servers": endpoints, "server_commands": server_cmds,
        "tensor_split": format_tensor_split(ts), "devices": res["devices"], "backends": res["backends"],
        "bench_tensor_split": res["bench_tensor_split"], "n_gpu_layers": res["n_gpu_layers"],
        "split": [f"{a}:{b}" for a, b in split], "per_server": per_server,
        "threads": threads, "n_prompt": n_prompt, "n_gen": n_gen, "repeats": repeats,
        "wall_s": wall, "server_devices": server_devices, "warnings": warnings,
    }
