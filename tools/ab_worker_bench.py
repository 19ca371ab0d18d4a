"""Paired A/B of two dgr-worker builds: `dgr bench worker` and `dgr bench route` with the worker
of a base commit against the worker of this checkout, the Python side (driver, yardsticks) the same.

    .venv/bin/python tools/ab_worker_bench.py --base COMMIT --out DIR [--pairs 2]

- The base worker is built from `git worktree add build/ab/<commit>/src COMMIT` into
  build/ab/<commit>/build with this checkout's CMake configuration (build/cpu/dgr-config.json), so
  the compiler flags and the patched llama.cpp tree are the same; only the worker's sources differ.
  The base must use the same llama.cpp pin and patch series (checked).
- Runs go in ABBA order per pair (head, base, base, head, ...), so a drift of the host over the
  session hits both sides alike. Before each run the host must settle below a 1-minute load of 0.5
  (bounded wait); the load is recorded next to each run.
- Every bench writes its own JSON (its ratios are paired with llama.cpp inside the same run);
  summary.json collects each run's judged ratios per side, their medians and base/head deltas.
Why a tool of its own: the acceptance of the scheduler's reshaping asks for these ratios "not
lower than before, paired"; the benches measure one build at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dgr.accept.evidence import settle

REPO = Path(__file__).resolve().parents[1]
DGR = REPO / ".venv" / "bin" / "dgr"
WORKER_KEYS = ("server_generation", "stepwise")
ROUTE_KEYS = ("route_decode_vs_llama_bench_tg", "route_prefill_vs_llama_bench_pp",
              "route_aggregate_decode_vs_batched_bench_B4", "route_decode_vs_whole_worker",
              "route_prefill_vs_whole_worker", "whole_worker_decode_vs_llama_bench_tg",
              "whole_worker_aggregate_decode_vs_batched_bench_B4")


def sh(cmd: list[str], **kw) -> str:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw).stdout.strip()


def build_base(commit: str) -> tuple[Path, str]:
    sha = sh(["git", "-C", str(REPO), "rev-parse", commit])
    root = REPO / "build" / "ab" / sha[:12]
    src, bdir = root / "src", root / "build"
    for f in ("upstream/llama.cpp.pin", "upstream/patches"):
        if sh(["git", "-C", str(REPO), "diff", "--stat", sha, "HEAD", "--", f]):
            sys.exit(f"{f} differs between {sha[:12]} and HEAD: the A/B would compare llama.cpp builds too")
    if not src.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(src), sha], check=True)
    config = json.loads((REPO / "build" / "cpu" / "dgr-config.json").read_text())
    config = [c.replace(f"-DDGR_REPO_ROOT={REPO}", f"-DDGR_REPO_ROOT={src}") for c in config]
    if not (bdir / "build.ninja").exists():
        subprocess.run(["cmake", "-S", str(src / "worker"), "-B", str(bdir), *config], check=True,
                       stdout=subprocess.DEVNULL)
    print(f"building the worker of {sha[:12]} in {bdir}", flush=True)
    subprocess.run(["ninja", "-C", str(bdir), "-j2", "dgr-worker"], check=True, stdout=subprocess.DEVNULL)
    return bdir / "bin" / "dgr-worker", sha


def judged(kind: str, doc: dict) -> dict[str, float]:
    if kind == "worker":
        return {f"{m}_paired_ratio_{lv['sessions']}": lv[m]["paired_ratio"] for lv in doc["levels"]
                for m in WORKER_KEYS if m in lv}
    pm = doc["ratios"]["paired_median"]
    return {k: pm[k] for k in ROUTE_KEYS if k in pm}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="commit whose worker is the 'before' side")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pairs", type=int, default=2, choices=range(1, 6))
    ap.add_argument("--route-repeats", type=int, default=3, choices=range(1, 11))
    ap.add_argument("--worker-repeats", type=int, default=3, choices=range(1, 11))
    ap.add_argument("--benches", default="worker,route", help="which benches, comma-separated: worker, route")
    a = ap.parse_args()
    benches = [b for b in a.benches.split(",") if b]
    if not benches or set(benches) - {"worker", "route"}:
        sys.exit(f"--benches wants worker and/or route, got {a.benches!r}")
    if sh(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]):
        sys.exit("the checkout has changes: the head side must be a recorded commit")
    head_sha = sh(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    base_bin, base_sha = build_base(a.base)
    head_bin = REPO / "build" / "cpu" / "bin" / "dgr-worker"
    # the head side is this checkout's worker: bring build/cpu up to date first (a no-op when it is)
    subprocess.run(["ninja", "-C", str(REPO / "build" / "cpu"), "-j2", "dgr-worker"], check=True,
                   stdout=subprocess.DEVNULL)
    sides = {"head": (head_bin, head_sha), "base": (base_bin, base_sha)}
    a.out.mkdir(parents=True, exist_ok=True)
    order = []
    for p in range(a.pairs):
        order += ["head", "base"] if p % 2 == 0 else ["base", "head"]
    runs: list[dict] = []
    for i, side in enumerate(order):
        exe, sha = sides[side]
        env = {**os.environ, "DGR_WORKER_BIN": str(exe)}
        for kind, args in (("worker", ["bench", "worker", "--repeats", str(a.worker_repeats)]),
                           ("route", ["bench", "route", "--repeats", str(a.route_repeats), "--no-rpc",
                                      "--no-llama-server"])):
            if kind not in benches:
                continue
            settle(limit_s=300.0)   # the release lane's wait for a quiet host (dgr.accept.evidence)
            load = list(os.getloadavg())
            path = a.out / f"{i + 1:02d}-{side}-{kind}.json"
            print(f"run {i + 1}/{len(order)}: {side} ({sha[:12]}) dgr {' '.join(args)}, load {load[0]:.2f}",
                  flush=True)
            t0 = time.monotonic()
            subprocess.run([str(DGR), *args, "--out", str(path)], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            doc = json.loads(path.read_text())
            runs.append({"index": i + 1, "side": side, "commit": sha, "worker_binary": str(exe), "kind": kind,
                         "file": path.name, "loadavg_before": load, "wall_s": round(time.monotonic() - t0, 1),
                         "ratios": judged(kind, doc)})
    summary: dict = {"schema": "dgr.ab-worker/1", "head": head_sha, "base": base_sha, "order": order,
                     "benches": benches,
                     "host": {"cpus": os.cpu_count()}, "runs": runs, "medians": {}, "head_minus_base": {}}
    for kind in ("worker", "route"):
        keys = sorted({k for r in runs if r["kind"] == kind for k in r["ratios"]})
        for k in keys:
            med = {s: statistics.median([r["ratios"][k] for r in runs if r["kind"] == kind and r["side"] == s
                                         and k in r["ratios"]]) for s in sides}
            summary["medians"][k] = med
            summary["head_minus_base"][k] = med["head"] - med["base"]
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for k, d in summary["head_minus_base"].items():
        m = summary["medians"][k]
        print(f"{k:58s} head {m['head']:.3f}  base {m['base']:.3f}  {d:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
