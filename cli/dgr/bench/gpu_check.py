"""Over 500 lines on purpose: every step of one device run, each short, read in order.

The steps of the GPU check (``tools/gpu-check.sh``; docs/backends.md, "Running the GPU check on a
lent machine") and the one JSON document it writes (schema ``dgr.gpu-check/1``).

``python -m dgr.bench.gpu_check STEP --step-id ID --out STEP.json [options]``, one process per
step (the script bounds each with ``timeout``):

- ``device``: the GPU (nvidia-smi), the host, the bundle's manifest;
- ``vulkan-device``: the Vulkan worker of a bundle with a Vulkan build (``--backend vulkan``): the
  devices it lists (``dgr-worker --smoke``), the loader it found, and the device (class) a worker
  on the model reports in GetCapability; target: the class ``--expect-class`` (``vulkan:nvidia``
  on the GPU machine: not Mesa's llvmpipe);
- ``cli``: one ``dgr`` command (``-- ARGS``), judged by ``--expect``: ``ok`` (exit 0), ``parity``
  (``route run --parity --json``: identical greedy tokens), ``drift`` (``route drift --json``:
  recorded), ``certified`` (``certify --json``: verdict pass, the evidence document kept in the
  result), ``refusal`` (a non-zero exit with the reason);
- ``worker-bench``: dgr-worker (server-side generation) vs llama-batched-bench at B sessions
  (:func:`dgr.bench.worker.run_worker_bench`), target >= 0.95x at every B;
- ``prefill``: one worker's prefill of N tokens in one piece vs llama-bench ppN, target >= 0.95x;
- ``route``: a 2-process route vs the whole model on one worker, both on this machine's device, at
  B concurrent greedy sessions: decode rate (target >= 0.9x), identical tokens, and each
  worker's memory: GetCapability.device's prediction vs nvidia-smi's per-process figure (CPU:
  the capacity's prediction vs the process's resident set), target within 10%;
- ``skip``: a step not run, with the reason;
- ``report``: the document from the step files (``--steps DIR``).

A step that does not write its file (killed at its deadline, crashed) is recorded by ``fallback``
from its exit status. With ``--backend cpu`` (the CPU dry run) the targets are not judged: the
step is ``measured`` with its numbers; so are the Vulkan steps of the dry run (on llvmpipe,
``DGR_GPU_CHECK_DRY_RUN=1``, which the script sets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

SCHEMA = "dgr.gpu-check/1"
TARGETS = {
    "worker_vs_llama_batched_bench": {"min_ratio": 0.95, "at_sessions": [1, 8, 32],
                                      "what": "dgr-worker aggregate decode (server-side generation) / "
                                              "llama-batched-bench S_TG, same GPU, same B"},
    "prefill_vs_llama_bench": {"min_ratio": 0.95, "what": "dgr-worker prefill of 512 tokens in one piece / llama-bench pp512"},
    "route_vs_whole": {"min_ratio": 0.9, "sessions": 8, "identical_tokens": True,
                       "what": "2-process route on one GPU / whole model on one worker, aggregate decode at B=8, "
                               "greedy tokens identical"},
    "vram_prediction": {"max_relative_error": 0.10,
                        "what": "GetCapability.device.memory_predicted_bytes vs nvidia-smi's used memory of the worker"},
    "certify": {"expect": "certified", "what": "dgr certify --backend cuda: exact greedy parity of a 2- and a 3-range "
                                               "split against the whole model on this GPU; the local evidence (device "
                                               "class, figures) comes back in the step's result"},
    "vulkan": {"device_class": "vulkan:nvidia", "identical_tokens": True, "certify": "certified",
               "worker_vs_llama_batched_bench": {"min_ratio": 0.95, "at_sessions": [1, 8]},
               "what": "with a Vulkan build in the bundle: the Vulkan worker on the GPU's driver (not llvmpipe), "
                       "2-range greedy parity vs the whole model on Vulkan, dgr certify --backend vulkan, and "
                       "dgr-worker vs llama-batched-bench (Vulkan) at B=1,8 when the deadline allows"},
}
STATUSES = ("pass", "fail", "measured", "skipped", "error")
MiB = 1 << 20


# ---- helpers ----------------------------------------------------------------------------------

def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


def _judged(backend: str) -> bool:
    """Targets are judged on an accelerator; the CPU dry run only measures (its Vulkan steps, on
    llvmpipe, too: DGR_GPU_CHECK_DRY_RUN=1)."""
    return backend != "cpu" and os.environ.get("DGR_GPU_CHECK_DRY_RUN") != "1"


def _status(ok: bool, backend: str) -> str:
    return ("pass" if ok else "fail") if _judged(backend) else "measured"


def _gpu_layers(backend: str) -> str | None:
    return None if backend == "cpu" else "99"


def _bundle_bins(backend: str) -> tuple[Path, Path, Path]:
    """The bundle's dgr-worker, llama-batched-bench and llama-bench of ``backend``; this step's
    process (and so they) sees the device a route would (a Vulkan worker: GGML_VK_VISIBLE_DEVICES,
    default the first device)."""
    from ..route.local import backend_env
    from ..upstream.build import worker_binary_path
    from .. import paths

    os.environ.update(backend_env(backend, {}))

    bin_dir = paths.backend_build_dir(backend) / "bin"
    return worker_binary_path(backend), bin_dir / "llama-batched-bench", bin_dir / "llama-bench"


def nvidia_smi_query(fields: Sequence[str], what: str = "gpu") -> list[dict[str, str]]:
    """``nvidia-smi --query-<what>=...`` as rows of {field: value} ([] without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return []
    r = subprocess.run(["nvidia-smi", f"--query-{what}={','.join(fields)}", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return []
    return [dict(zip(fields, (c.strip() for c in line.split(",")))) for line in r.stdout.splitlines() if line.strip()]


def gpu_process_memory() -> dict[int, int]:
    """pid -> used GPU memory in bytes (nvidia-smi's per-process figure)."""
    out: dict[int, int] = {}
    for row in nvidia_smi_query(("pid", "used_memory"), "compute-apps"):
        try:
            out[int(row["pid"])] = int(float(row["used_memory"]) * MiB)
        except (KeyError, ValueError):
            continue
    return out


def gpu_used_bytes() -> int | None:
    rows = nvidia_smi_query(("memory.used",))
    try:
        return int(float(rows[0]["memory.used"]) * MiB) if rows else None
    except (KeyError, ValueError):
        return None


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_info_dict(dev: Any) -> dict[str, Any]:
    return {f: getattr(dev, f) for f in ("backend", "name", "description", "vendor", "driver_version", "architecture",
                                          "device_class", "memory_total_bytes", "memory_free_bytes",
                                          "memory_predicted_bytes")}


# ---- steps ------------------------------------------------------------------------------------

def step_preflight(args: argparse.Namespace) -> dict:
    """Unpack the carried bundle (``--bundle``, its archive checked against its manifest) into the
    build dir (DGR_BUILD_DIR); can its programs load here (every library found: ldd) and run
    (dgr-worker --version)? A Vulkan build that cannot (no loader here) fails only the Vulkan
    steps: it is named under ``unusable_backends`` and the preflight passes on the others."""
    from .. import paths
    from ..upstream.build import bundle_manifest
    from ..upstream.bundle import TARGETS as PROGRAMS, unpack

    t0 = time.monotonic()
    unpack(Path(args.bundle), paths.build_dir())
    unpack_s = round(time.monotonic() - t0, 2)
    manifest = bundle_manifest()
    if manifest is None:
        return {"status": "fail", "reason": f"{paths.build_dir()} holds no dgr-bundle.json after unpacking"}
    rows, problems, unusable = [], [], set()
    optional = {"vulkan"} - {args.backend}
    for b in manifest.get("backends", []):
        for name in PROGRAMS:
            exe = paths.backend_build_dir(b) / "bin" / name
            ldd = subprocess.run(["ldd", str(exe)], capture_output=True, text=True, timeout=60)
            missing = sorted({ln.split()[0] for ln in ldd.stdout.splitlines() if "not found" in ln})
            bad_version = sorted({ln.strip() for ln in (ldd.stdout + ldd.stderr).splitlines() if "version `" in ln})
            run = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60) \
                if name == "dgr-worker" and not missing else None
            row = {"backend": b, "program": name, "missing_libraries": missing, "symbol_version_errors": bad_version[:5],
                   "version": (run.stdout or run.stderr).strip()[:300] if run else None,
                   "runs": (run.returncode == 0) if run else None}
            rows.append(row)
            if missing or bad_version or (run is not None and run.returncode != 0):
                unusable.add(b)
                problems.append(f"{b}/bin/{name}: " + ", ".join(missing + bad_version[:1]
                                                               + ([f"--version exit {run.returncode}"] if run and run.returncode else [])))
    fatal = bool(unusable - optional)
    return {"status": "fail" if fatal else "pass",
            "result": {"programs": rows, "unpacked_into": str(paths.build_dir()), "unpack_seconds": unpack_s,
                       "unusable_backends": sorted(unusable), "problems": problems,
                       "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
                       "python": sys.version.split()[0], "manifest_needs": manifest.get("needs")},
            "reason": "; ".join(problems)[:1000] if fatal else None}


def step_device(args: argparse.Namespace) -> dict:
    from .. import paths
    from ..upstream.build import bundle_manifest

    gpus = nvidia_smi_query(("name", "uuid", "driver_version", "memory.total", "memory.used", "compute_cap",
                             "pcie.link.gen.current", "clocks.max.sm", "power.limit"))
    manifest = _outer_manifest(args) or bundle_manifest() or {}
    worker, _, _ = _bundle_bins(args.backend)
    version = subprocess.run([str(worker), "--version"], capture_output=True, text=True, timeout=60) \
        if worker.is_file() else None
    result = {
        "gpus": gpus,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "kernel": platform.release(),
                 "python": sys.version.split()[0], "loadavg": list(os.getloadavg())},
        "build_dir": str(paths.build_dir()),
        "bundle": {k: manifest.get(k) for k in ("kind", "backend", "backends", "cuda_architectures", "git_commit",
                                                "git_dirty_files", "pin_commit", "dgr_version", "bundle_bytes",
                                                "unpacked_bytes", "tree_bytes", "travel_bytes", "needs", "debs")},
        "worker_version": (version.stdout or version.stderr).strip() if version else None,
    }
    ok = bool(gpus) if _judged(args.backend) else True
    return {"status": "pass" if ok else "fail", "result": result,
            "reason": None if ok else "nvidia-smi lists no GPU"}


def step_vulkan_device(args: argparse.Namespace) -> dict:
    """The devices the bundle's Vulkan worker lists (``--smoke``) and the device a worker on
    ``--model`` reports (GetCapability), both as a route starts them (GGML_VK_VISIBLE_DEVICES,
    default the first device: without it ggml-vulkan leaves out CPU devices such as llvmpipe);
    pass when its class is ``--expect-class``."""
    from ..protocol.client import WorkerClient
    from ..route.local import backend_env
    from ..route.supervisor import WorkerArgs, WorkerProcess

    worker, _, _ = _bundle_bins("vulkan")
    env_vk = backend_env("vulkan", {})
    r = subprocess.run([str(worker), "--smoke"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env_vk})
    listed = [f"{m.group(1)} = {m.group(2).strip()}" for m in
              re.finditer(r"(?m)^\s*ggml_vulkan:\s+(\d+)\s*=\s*(.+)$", r.stdout + r.stderr)]
    env = {k: {**os.environ, **env_vk}.get(k) for k in ("LD_LIBRARY_PATH", "VK_DRIVER_FILES", "VK_ICD_FILENAMES",
                                                        "__EGL_VENDOR_LIBRARY_FILENAMES", "GGML_VK_VISIBLE_DEVICES")}
    result: dict[str, Any] = {"listed": listed, "smoke_exit": r.returncode, "loader": args.loader, "environment": env,
                              "expected_class": args.expect_class}
    if r.returncode != 0 or not listed:
        result["smoke_tail"] = (r.stdout + r.stderr).strip()[-1500:]
        return {"status": "fail", "result": result,
                "reason": f"the Vulkan worker lists no device (--smoke exit {r.returncode})"}
    wa = WorkerArgs(model=Path(args.model), max_sessions=1, ctx_per_session=64, threads=args.threads)
    with WorkerProcess.start(wa, binary=worker, ready_timeout=300, env=env_vk) as w:
        with WorkerClient(w.target, timeout=120) as c:
            dev = device_info_dict(c.capability().device)
    result["device"] = dev
    ok = dev.get("device_class") == args.expect_class
    return {"status": "pass" if ok else "fail", "target": {"device_class": args.expect_class}, "result": result,
            "reason": None if ok else f"the Vulkan worker runs on {dev.get('device_class')!r} "
                                      f"({dev.get('description')}), not {args.expect_class}"}


def _cli_json(stdout: str) -> Any:
    start = stdout.find("{")
    if start < 0:
        return None
    try:
        return json.loads(stdout[start:])
    except json.JSONDecodeError:
        return None


def step_cli(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "dgr.main", *args.cli]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    sys.stderr.write(r.stderr[-20000:])
    out: dict[str, Any] = {"command": "dgr " + " ".join(args.cli), "exit": r.returncode, "wall_s": round(wall, 2)}
    tail = (r.stderr.strip().splitlines() or [""])[-1]
    doc = _cli_json(r.stdout) if args.expect in ("parity", "drift", "json", "certified") else None
    if args.expect == "refusal":
        message = (r.stderr.strip() or r.stdout.strip())[-600:]
        refused = r.returncode != 0 and "Traceback" not in r.stderr
        out["result"] = {"refused": refused, "message": message,
                         "names_no_cuda_entry": bool(re.search(r"backend plan cuda|not in the registry|is dark", message))}
        out["status"] = "pass" if refused else "fail"
        out["reason"] = None if refused else ("it did not refuse (exit 0)" if r.returncode == 0 else "it crashed")
        return out
    if args.expect == "ok":
        out["result"] = {"stdout_tail": r.stdout.strip()[-400:]}
        out["status"] = "pass" if r.returncode == 0 else "error"
        out["reason"] = None if r.returncode == 0 else tail
        return out
    if doc is None:
        out["status"] = "error"
        out["reason"] = f"no JSON on stdout (exit {r.returncode}): {tail}"
        return out
    if args.expect == "parity":
        par = doc.get("parity") or {}
        route = doc.get("route") or {}
        whole = doc.get("whole") or {}
        out["result"] = {
            "split": doc.get("split"), "backends": doc.get("backends"), "whole_backend": doc.get("whole_backend"),
            "parity": par, "isolation": doc.get("isolation"),
            "route_tokens": [s.get("tokens") for s in route.get("sessions", [])],
            "whole_tokens": [s.get("tokens") for s in whole.get("sessions", [])],
            "route_decode_tok_s": [s.get("decode_tok_s") for s in route.get("sessions", [])],
            "whole_decode_tok_s": [s.get("decode_tok_s") for s in whole.get("sessions", [])],
        }
        ok = bool(par.get("ok")) and r.returncode == 0
        # parity is exact on every backend (the same kernels on both sides): judged on the CPU too
        out["status"] = "pass" if ok else "fail"
        out["reason"] = None if ok else f"greedy tokens differ (first divergence {par.get('first_divergence')}; exit {r.returncode})"
        return out
    if args.expect == "certified":
        # judged on the CPU too: certification is exact parity on one device, whatever it is
        ok = r.returncode == 0 and doc.get("verdict") == "pass"
        out["result"] = {"verdict": doc.get("verdict"), "entry": doc.get("entry"), "plan": doc.get("plan"),
                         "device_classes": doc.get("device_classes"),
                         "identical": [(run.get("parity") or {}).get("identical") for run in doc.get("runs", [])],
                         "evidence": doc}
        out["status"] = "pass" if ok else "fail"
        out["reason"] = None if ok else f"not certified (exit {r.returncode}): {tail}"
        return out
    if args.expect == "drift":
        out["result"] = doc
        out["status"] = "measured" if r.returncode in (0, 1) else "error"
        out["reason"] = None if out["status"] == "measured" else tail
        return out
    out["result"] = doc
    out["status"] = "pass" if r.returncode == 0 else "error"
    return out


def step_worker_bench(args: argparse.Namespace) -> dict:
    from .worker import WorkerBenchConfig, run_worker_bench

    worker, batched, _ = _bundle_bins(args.backend)
    levels = tuple(int(x) for x in args.levels.split(","))
    cfg = WorkerBenchConfig(levels=levels, prompt_tokens=args.n_prompt, gen_tokens=args.n_gen, threads=args.threads,
                            repeats=args.repeats, gpu_layers=_gpu_layers(args.backend),
                            batched_bench_attempts=8)   # its rows get lost now and then (llama_tools)
    doc = run_worker_bench(Path(args.model), cfg, worker_bin=worker, batched_bench=batched)
    target = TARGETS["worker_vs_llama_batched_bench"]["min_ratio"]
    rows = [{"sessions": r["sessions"], "worker_tok_s": r["worker_decode_tokens_per_s"],
             "llama_batched_bench_tok_s": r["llama_batched_bench_tg_tokens_per_s"], "ratio": r["ratio"],
             "paired_ratio": r.get("paired_ratio"), "stepwise_ratio": r.get("stepwise", {}).get("ratio"),
             "occupancy": r["dgr_batch_occupancy_avg"], "meets": r["ratio"] is not None and r["ratio"] >= target}
            for r in doc["levels"]]
    ok = bool(rows) and all(r["meets"] for r in rows)
    worst = min(rows, key=lambda r: r["ratio"] or 0.0) if rows else None
    return {"status": _status(ok, args.backend), "target": {"min_ratio": target},
            "result": {"levels": rows, "config": doc["config"], "worker_binary": doc["worker_binary"], "bench": doc},
            "reason": None if ok or not _judged(args.backend) else
            f"B={worst['sessions']}: {worst['ratio'] or 0:.3f}x < {target}x" if worst else "no levels"}


async def _prefill_runs(target: str, n: int, repeats: int) -> list[float]:
    from ..protocol.client import AsyncWorkerClient

    client = AsyncWorkerClient(target, timeout=600)
    walls: list[float] = []
    try:
        span = max(1, min(1000, (await client.capability()).identity.n_vocab - 10))
        for rep in range(repeats + 1):           # the first is a warm-up
            ids = [(31 * i + 7 * rep) % span + 10 for i in range(n)]
            s = await client.open_session(step_timeout=600)
            try:
                t0 = time.perf_counter()
                await s.prefill(ids, chunk=n)
                wall = time.perf_counter() - t0
            finally:
                await s.close()
            for _ in range(500):
                if (await client.load()).active_sessions == 0:
                    break
                await asyncio.sleep(0.01)
            if rep:
                walls.append(wall)
    finally:
        await client.close()
    return walls


def step_prefill(args: argparse.Namespace) -> dict:
    from ..route.supervisor import WorkerArgs, WorkerProcess
    from . import llama_tools

    worker, _, bench = _bundle_bins(args.backend)
    n = args.n_prompt
    wa = WorkerArgs(model=Path(args.model), max_sessions=1, ctx_per_session=n + 16, threads=args.threads,
                    max_prefill_chunk=n, max_batch_tokens=max(512, n))
    with WorkerProcess.start(wa, binary=worker, ready_timeout=300) as w:
        walls = asyncio.run(_prefill_runs(w.target, n, args.repeats))
    worker_tok_s = n / min(walls)
    rows, m = llama_tools.llama_bench(bench, Path(args.model), threads=args.threads, n_prompt=n, n_gen=0,
                                      reps=args.repeats, gpu_layers=_gpu_layers(args.backend), timeout=600)
    pp = next((r.avg_ts for r in rows if r.is_prefill), None)
    ratio = worker_tok_s / pp if pp else None
    target = TARGETS["prefill_vs_llama_bench"]["min_ratio"]
    ok = ratio is not None and ratio >= target
    return {"status": _status(ok, args.backend), "target": {"min_ratio": target},
            "result": {"n_prompt": n, "worker_tok_s": worker_tok_s, "worker_walls_s": walls,
                       "llama_bench_pp_tok_s": pp, "ratio": ratio, "llama_bench_command": m.shown,
                       "worker_options": {"max_prefill_chunk": n, "max_batch_tokens": max(512, n),
                                          "threads": args.threads}},
            "reason": None if ok or not _judged(args.backend) else f"pp{n}: {ratio or 0:.3f}x < {target}x"}


def _token_prompts(n_vocab: int, n: int, sessions: int) -> list[list[int]]:
    span = max(1, min(1000, n_vocab - 10))
    return [[(13 * i + 101 * s) % span + 10 for i in range(n)] for s in range(sessions)]


def _memory_rows(route: Any, caps: list[Any], before_used: int | None, backend: str) -> tuple[list[dict], dict]:
    """Per worker: predicted vs measured memory (GPU: nvidia-smi's per-process figure; CPU: the
    resident set against the capacity's prediction); and for all of them together the device's
    used memory before they started and now (cudaMemGetInfo's view, as nvidia-smi reports it)."""
    per_pid = gpu_process_memory() if backend != "cpu" else {}
    rows = []
    for w, (a, b), cap in zip(route.workers, route.split, caps):
        dev = cap.device
        predicted = dev.memory_predicted_bytes if backend != "cpu" else cap.capacity.predicted_memory_bytes
        measured = per_pid.get(w.pid) if backend != "cpu" else rss_bytes(w.pid)
        err = abs(predicted - measured) / measured if predicted and measured else None
        rows.append({"layers": f"{a}:{b}", "pid": w.pid, "device": device_info_dict(dev),
                     "metrics": _device_metrics(w.target),
                     "capacity_predicted_bytes": cap.capacity.predicted_memory_bytes,
                     "predicted_bytes": predicted, "measured_bytes": measured,
                     "measured_by": "nvidia-smi --query-compute-apps used_memory" if backend != "cpu" else "VmRSS",
                     "relative_error": err})
    group: dict[str, Any] = {}
    if backend != "cpu":
        after = gpu_used_bytes()
        delta = (after - before_used) if after is not None and before_used is not None else None
        total = sum(r["predicted_bytes"] or 0 for r in rows)
        group = {"device_used_before_bytes": before_used, "device_used_after_bytes": after,
                 "device_used_delta_bytes": delta, "predicted_total_bytes": total,
                 "relative_error": abs(total - delta) / delta if delta and total else None}
    return rows, group


def _device_metrics(target: str) -> dict[str, float]:
    """The worker's dgr_device_memory_* gauges (GetMetrics), after its sessions ran."""
    from ..protocol.client import WorkerClient

    try:
        with WorkerClient(target, timeout=30) as c:
            return {m.name + "".join(f"{{{k}={v}}}" for k, v in sorted(m.labels.items())): m.value
                    for m in c.metrics().samples if m.name.startswith("dgr_device_memory")}
    except Exception as exc:  # noqa: BLE001 - recorded, never fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


async def _route_runs(endpoints: list[str], prompts: list[list[int]], n_gen: int, repeats: int) -> dict:
    from ..route.driver import Sampling
    from ..route.sessions import run_sessions

    best, tokens, stable = 0.0, None, True
    for _ in range(repeats):
        rep = await run_sessions(endpoints, [""] * len(prompts), token_prompts=prompts, max_tokens=n_gen,
                                 sampling=Sampling(ignore_eog=True), stop_on_eog=False, chat=False, label="gpu-check",
                                 timeout=600)
        if not rep.ok:
            raise RuntimeError("a session failed: " + "; ".join(s.error or "" for s in rep.sessions if s.error))
        rate = rep.concurrent_decode_tok_s or rep.aggregate_decode_tok_s
        best = max(best, rate)
        toks = [list(s.tokens) for s in rep.sessions]
        if tokens is None:
            tokens = toks
        elif toks != tokens:
            stable = False
        mode = rep.mode
    return {"decode_tok_s": best, "tokens": tokens, "tokens_stable_over_repeats": stable, "mode": mode}


def step_route(args: argparse.Namespace) -> dict:
    from ..protocol.client import WorkerClient
    from ..route.local import LocalRoute, model_n_layer, parse_split

    model = Path(args.model)
    n_layer = model_n_layer(model)
    split = parse_split(args.split)
    ctx = args.n_prompt + args.n_gen + 16
    out: dict[str, Any] = {"split": args.split, "sessions": args.sessions, "n_prompt": args.n_prompt,
                           "n_gen": args.n_gen, "threads": args.threads}
    runs: dict[str, dict] = {}
    memory: dict[str, list] = {}
    groups: dict[str, dict] = {}
    for name, rng in (("whole", [(0, n_layer)]), ("route", split)):
        before = gpu_used_bytes() if args.backend != "cpu" else None
        with LocalRoute(model, rng, backend=args.backend, threads=args.threads, max_sessions=args.sessions,
                        ctx_per_session=ctx) as lr:
            caps = []
            for ep in lr.endpoints:
                with WorkerClient(ep, timeout=60) as c:
                    caps.append(c.capability())
            prompts = _token_prompts(caps[0].identity.n_vocab, args.n_prompt, args.sessions)
            runs[name] = asyncio.run(_route_runs(lr.endpoints, prompts, args.n_gen, args.repeats))
            memory[name], groups[name] = _memory_rows(lr, caps, before, args.backend)
    ratio = runs["route"]["decode_tok_s"] / runs["whole"]["decode_tok_s"] if runs["whole"]["decode_tok_s"] else None
    identical = runs["route"]["tokens"] == runs["whole"]["tokens"]
    first_div = []
    for r, w in zip(runs["route"]["tokens"], runs["whole"]["tokens"]):
        first_div.append(next((i for i, (x, y) in enumerate(zip(r, w)) if x != y), None))
    target = TARGETS["route_vs_whole"]["min_ratio"]
    tol = TARGETS["vram_prediction"]["max_relative_error"]
    mem_rows = memory["whole"] + memory["route"]
    errs = [r["relative_error"] for r in mem_rows if r["relative_error"] is not None]
    if len(errs) != len(mem_rows):
        # no per-process figure (nvidia-smi lists no process here): each run's total against the
        # device's used memory before and after its workers started
        errs = [g["relative_error"] for g in groups.values() if g.get("relative_error") is not None]
        judged_on = "device used-memory delta per run (no per-process figure)"
    else:
        judged_on = "per worker"
    vram_ok = bool(errs) and max(errs) <= tol
    speed_ok = ratio is not None and ratio >= target
    out.update({"whole_decode_tok_s": runs["whole"]["decode_tok_s"], "route_decode_tok_s": runs["route"]["decode_tok_s"],
                "ratio": ratio, "identical_tokens": identical, "first_divergence": first_div,
                "modes": {k: v["mode"] for k, v in runs.items()},
                "tokens_stable_over_repeats": {k: v["tokens_stable_over_repeats"] for k, v in runs.items()},
                "tokens_compared": sum(len(t) for t in runs["whole"]["tokens"]),
                "memory": mem_rows, "memory_runs": groups, "memory_judged_on": judged_on,
                "memory_max_relative_error": max(errs) if errs else None,
                "judged": {"speed": _status(speed_ok, args.backend), "tokens": "pass" if identical else "fail",
                           "vram": _status(vram_ok, args.backend)}})
    ok = speed_ok and identical and vram_ok
    reasons = []
    if not speed_ok:
        reasons.append(f"route/whole {ratio or 0:.3f}x < {target}x")
    if not identical:
        reasons.append(f"greedy tokens differ (first divergence per session {first_div})")
    if not vram_ok:
        reasons.append(f"VRAM prediction off by {max(errs) if errs else float('nan'):.1%} (> {tol:.0%}) or unmeasured")
    status = _status(ok, args.backend)
    if not _judged(args.backend) and not identical:
        status = "fail"   # identical tokens hold on the CPU as well (same kernels, same batch shapes)
    return {"status": status, "target": {"min_ratio": target, "identical_tokens": True, "vram_max_relative_error": tol},
            "result": out, "reason": "; ".join(reasons) if reasons and status != "measured" else None}


def step_skip(args: argparse.Namespace) -> dict:
    return {"status": "skipped", "reason": args.reason}


def step_fallback(args: argparse.Namespace) -> dict:
    timed_out = args.exit in (124, 137)
    return {"status": "error", "exit": args.exit,
            "reason": (f"stopped at its deadline ({args.limit} s)" if timed_out
                       else f"exited {args.exit} without a result (see the log)")}


# ---- the document -----------------------------------------------------------------------------

def report(args: argparse.Namespace) -> dict:
    from ..upstream.build import bundle_manifest

    steps_dir = Path(args.steps)
    order = [s for s in (args.order or "").split(",") if s]
    files = {p.stem: p for p in steps_dir.glob("*.json")}
    names = order + sorted(set(files) - set(order))
    steps = []
    for name in names:
        if name not in files:
            steps.append({"step": name, "status": "error", "reason": "no result recorded"})
            continue
        try:
            steps.append(json.loads(files[name].read_text()))
        except (OSError, ValueError) as exc:
            steps.append({"step": name, "status": "error", "reason": f"unreadable result: {exc}"})
    counts = {s: sum(1 for st in steps if st.get("status") == s) for s in STATUSES}
    device = next((st.get("result") for st in steps if st.get("step") == "device"), None)
    worker_devices = []
    for st in steps:
        for row in (st.get("result") or {}).get("memory", []) if isinstance(st.get("result"), dict) else []:
            worker_devices.append(row.get("device"))
    manifest = _outer_manifest(args) or bundle_manifest() or {}
    doc = {
        "kind": SCHEMA,
        "mode": "cpu-dry-run" if args.backend == "cpu" else args.backend,
        "backend": args.backend,
        "started": args.started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.time() - float(args.started_epoch), 1) if args.started_epoch else None,
        "commit": {"git_commit": manifest.get("git_commit"), "git_dirty_files": manifest.get("git_dirty_files"),
                   "dgr_version": manifest.get("dgr_version"), "pin_commit": manifest.get("pin_commit")},
        "device": {"nvidia_smi": (device or {}).get("gpus"), "host": (device or {}).get("host"),
                   "worker_device_info": next((d for d in worker_devices if d), None),
                   "worker_version": (device or {}).get("worker_version")},
        "bundle": {k: manifest.get(k) for k in ("backend", "backends", "cuda_architectures", "bundle_bytes",
                                                "unpacked_bytes", "tree_bytes", "travel_bytes")},
        "targets": TARGETS,
        "targets_judged": _judged(args.backend),
        "steps": steps,
        "summary": {**counts, "steps": len(steps),
                    "verdict": ("fail" if counts["fail"] else "incomplete" if counts["error"] else "pass")},
    }
    return doc


def _outer_manifest(args: argparse.Namespace) -> dict | None:
    """The carried bundle's own manifest (with the archive's and the wheels' sizes)."""
    if not getattr(args, "bundle", None):
        return None
    try:
        return json.loads((Path(args.bundle) / "dgr-bundle.json").read_text())
    except (OSError, ValueError):
        return None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--title", default="")
    p.add_argument("--bundle", default="", help="the carried bundle folder (its dgr-bundle.json and archive)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgr.bench.gpu_check", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("device"); _common(p)
    p = sub.add_parser("preflight"); _common(p)
    p = sub.add_parser("vulkan-device"); _common(p)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--expect-class", default="vulkan:nvidia")
    p.add_argument("--loader", default="", help="where the script found the Vulkan loader")
    p = sub.add_parser("cli"); _common(p)
    p.add_argument("--expect", choices=("ok", "parity", "drift", "refusal", "json", "certified"), default="ok")
    p.add_argument("cli", nargs=argparse.REMAINDER)
    for name in ("worker-bench", "prefill", "route"):
        p = sub.add_parser(name); _common(p)
        p.add_argument("--model", required=True)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--repeats", type=int, default=2)
        p.add_argument("--n-prompt", type=int, default=32)
        p.add_argument("--n-gen", type=int, default=64)
        if name == "worker-bench":
            p.add_argument("--levels", default="1,8,32")
        if name == "route":
            p.add_argument("--split", required=True)
            p.add_argument("--sessions", type=int, default=8)
    p = sub.add_parser("skip"); _common(p)
    p.add_argument("--reason", required=True)
    p = sub.add_parser("fallback"); _common(p)
    p.add_argument("--exit", type=int, required=True)
    p.add_argument("--limit", type=int, default=0)
    p = sub.add_parser("report")
    p.add_argument("--steps", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--order", default="")
    p.add_argument("--started", default="")
    p.add_argument("--started-epoch", default="")
    p.add_argument("--bundle", default="")
    args = ap.parse_args(argv)
    if args.cmd == "cli" and args.cli and args.cli[0] == "--":
        args.cli = args.cli[1:]
    if args.cmd == "report":
        doc = report(args)
        _write(Path(args.out), doc)
        s = doc["summary"]
        print(f"gpu-check ({doc['mode']}): {s['steps']} steps: {s['pass']} pass, {s['fail']} fail, "
              f"{s['measured']} measured, {s['skipped']} skipped, {s['error']} error -> {s['verdict']}")
        for st in doc["steps"]:
            print(f"  {st.get('step', '?'):<22} {st.get('status', '?'):<9} {st.get('seconds', '')!s:>7}  "
                  f"{_headline(st)}")
        return 0
    fn = {"preflight": step_preflight, "device": step_device, "vulkan-device": step_vulkan_device, "cli": step_cli, "worker-bench": step_worker_bench, "prefill": step_prefill,
          "route": step_route, "skip": step_skip, "fallback": step_fallback}[args.cmd]
    t0 = time.monotonic()
    try:
        res = fn(args)
    except Exception as exc:  # noqa: BLE001 - one step's failure is recorded, the check goes on
        import traceback

        traceback.print_exc()
        res = {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[-500:]}"}
    doc = {"step": args.step_id, "title": args.title, "kind": args.cmd, "backend": args.backend,
           "seconds": round(time.monotonic() - t0, 2), **res}
    if doc.get("status") not in STATUSES:
        doc["status"] = "error"
    _write(Path(args.out), doc)
    print(f"gpu-check step {args.step_id}: {doc['status']} ({doc['seconds']} s){': ' + doc['reason'] if doc.get('reason') else ''}",
          file=sys.stderr)
    return 0


def _headline(st: dict) -> str:
    r = st.get("result") if isinstance(st.get("result"), dict) else {}
    if st.get("kind") == "worker-bench" and r.get("levels"):
        return "  ".join(f"B={x['sessions']} {x['ratio'] or 0:.2f}x" for x in r["levels"])
    if st.get("kind") == "prefill" and r.get("ratio") is not None:
        return f"pp{r['n_prompt']} {r['worker_tok_s']:.0f} vs {r['llama_bench_pp_tok_s']:.0f} tok/s = {r['ratio']:.2f}x"
    if st.get("kind") == "route" and r.get("ratio") is not None:
        mem = r.get("memory_max_relative_error")
        return (f"B={r['sessions']} {r['ratio']:.2f}x, tokens {'identical' if r['identical_tokens'] else 'DIFFER'}, "
                f"memory prediction off by {mem:.1%}" if mem is not None else
                f"B={r['sessions']} {r['ratio']:.2f}x, tokens {'identical' if r['identical_tokens'] else 'DIFFER'}")
    if st.get("kind") == "cli" and isinstance(r.get("parity"), dict):
        p = r["parity"]
        return f"parity {p.get('agreeing_tokens')}/{p.get('compared_tokens')} tokens, ok={p.get('ok')}"
    if st.get("kind") == "vulkan-device" and isinstance(r.get("device"), dict):
        return f"{r['device'].get('device_class')}: {r['device'].get('description')}"
    if st.get("kind") == "cli" and "verdict" in r:
        return f"{r['verdict']}: plan {r.get('plan')} on {', '.join(r.get('device_classes') or []) or '?'}"
    if st.get("kind") == "cli" and "refused" in r:
        return f"refused={r['refused']}: {r['message'].splitlines()[-1][:90] if r['message'] else ''}"
    return (st.get("reason") or "")[:100]


if __name__ == "__main__":
    sys.exit(main())
