"""A host's measured capability for route planning (``dgr worker probe``): the worker's own probe
(``dgr-worker probe --json``, docs/worker.md "Measured capability") turned into the figures
``dgr plan`` reads (cli/dgr/route/planner.py, schema dgr.capabilities.v1)."""

from __future__ import annotations

import math

import json
import logging
import os
import socket
import subprocess
from pathlib import Path
from typing import Any, Sequence

from .. import childproc
from ..errors import DgrError
from .planner import CAPABILITY_SCHEMA, HostCapability, ModelShape, parse_capabilities
from .supervisor import default_binary

_log = logging.getLogger(__name__)

# a tail of a few layers measures a layer and the output matrix apart, and loads little
PROBE_TAIL_LAYERS = 4


def default_probe_range(n_layer: int) -> tuple[int, int]:
    return max(0, n_layer - PROBE_TAIL_LAYERS), n_layer


def run_probe(model: Path, layers: tuple[int, int] | None = None, *, threads: int | None = None,
              budget_s: float = 5.0, binary: Path | None = None, prefix: Sequence[str] = (),
              timeout_s: float = 600.0) -> dict[str, Any]:
    """``dgr-worker probe --json`` for ``model`` and ``layers`` (the worker loads the range as it
    would to serve it); ``prefix``: a command to run it under (a lab host's namespace). The
    probe's JSON; DgrError when the worker cannot load or measure."""
    exe = binary or default_binary()
    if not Path(exe).is_file():
        raise DgrError(f"{exe} not built", hint="run `dgr build --backend cpu`")
    cmd = [*prefix, str(exe), "probe", "--json", "--model", str(model), "--probe-budget-s", f"{budget_s:g}",
           "--max-sessions", "16", "--ctx-per-session", "256"]
    if layers is not None:
        cmd += ["--layers", f"{layers[0]}:{layers[1]}"]
    if threads:
        cmd += ["--threads", str(threads)]
    _log.debug("probing %s layers %s (%s)", Path(model).name, layers or "all", " ".join(cmd))
    # a child that does not outlive this process (childproc: the parent-death signal)
    p = childproc.popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise DgrError(f"dgr-worker probe did not finish within {timeout_s:g} s") from None
    except BaseException:   # Ctrl-C, SIGTERM's exception: the probe goes with us
        p.kill()
        p.communicate()
        raise
    errs = [ln for ln in err.splitlines() if "error" in ln]
    if p.returncode != 0:
        raise DgrError(f"dgr-worker probe failed for {model} layers {layers}: "
                       + (errs[-1] if errs else f"exit {p.returncode}"))
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as exc:
        raise DgrError(f"dgr-worker probe printed no JSON for {model}: {exc}") from None


def capability_from_probe(probe: dict[str, Any], shape: ModelShape, *, name: str, memory_bytes: int,
                          endpoint: str = "", output_ratio: dict[int, float] | None = None) -> dict[str, Any]:
    """The planner's host entry from a probe of a tail range: the range's step without logits
    over its layers' weight in mean layers, and the logits' share apart. A probe of a range
    that is not a tail measures no output matrix: refused (probe the model's last layers), unless
    ``output_ratio`` (output matrix / mean layer, per batch size, from another host's tail probe)
    stands in for it; the entry then says ``output_estimated``."""
    if not probe.get("tail") and output_ratio is None:
        raise DgrError("the probe's range is not a tail: it measured no output matrix",
                       hint="probe a range that ends at the model's last layer (the default)")
    if probe.get("error"):
        raise DgrError(f"the probe stopped: {probe['error']}")
    a, b = int(probe["layer_start"]), int(probe["layer_end"])
    if not 0 <= a < b <= shape.n_layer or int(probe["n_layer"]) != shape.n_layer:
        raise DgrError(f"the probe's range {a}:{b} of {probe.get('n_layer')} layers does not match the model's "
                       f"{shape.n_layer}")
    mean = sum(shape.layer_elements) / shape.n_layer
    eq = sum(shape.layer_elements[a:b]) / mean   # the range in mean layers
    dec, dec0 = probe.get("decode_s") or {}, probe.get("decode_no_output_s") or {}
    tail = bool(probe.get("tail"))
    if not tail:   # no logits were computed: the whole step is the layers'
        dec0 = dec
    rows = sorted(int(k) for k in dec if k in dec0 and (tail or output_ratio is None or
                                                         _nearest(output_ratio, int(k)) is not None))
    if not rows:
        raise DgrError("the probe measured no decode step")
    for what, v in [*((f"decode_s[{r}]", dec[str(r)]) for r in rows),
                    *((f"decode_no_output_s[{r}]", dec0[str(r)]) for r in rows),
                    ("prompt_s_per_token", probe.get("prompt_s_per_token") or 0.0),
                    ("prompt_no_output_s_per_token", probe.get("prompt_no_output_s_per_token") or 0.0)]:
        # checked before the clamps below, which would turn a NaN into 1 ns
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise DgrError(f"the probe's {what} is {v!r}: not a finite, non-negative number of seconds")
    layer = {r: max(1e-9, dec0[str(r)] / eq) for r in rows}
    if tail:
        output = {r: max(1e-9, dec[str(r)] - dec0[str(r)]) for r in rows}
    else:
        output = {r: max(1e-9, layer[r] * _nearest(output_ratio, r)) for r in rows}
    p, p0 = float(probe.get("prompt_s_per_token") or 0.0), float(probe.get("prompt_no_output_s_per_token") or 0.0)
    if not tail:
        p0 = p
    layer_prefill = p0 / eq if p0 > 0 else layer[rows[0]] / 2   # unmeasured: half a 1-row step
    entry = {"name": name, "endpoint": endpoint, "memory_bytes": int(memory_bytes),
             "layer_decode_s": {str(r): layer[r] for r in rows}, "layer_prefill_s": max(1e-9, layer_prefill),
             "output_decode_s": {str(r): output[r] for r in rows}, "output_prefill_s": output[rows[0]],
             "embed_s": 0.0, "duty": _duty(probe), **({} if tail else {"output_estimated": True}),
             "probe": {"layers": [a, b], "threads": probe.get("threads"), "backend": probe.get("backend"),
                       "skipped_rows": probe.get("skipped", []), "seconds": probe.get("seconds"),
                       "sustained_s": probe.get("sustained_s"), "duty_measured": probe.get("duty"),
                       "fake": bool(probe.get("fake"))}}
    parse_capabilities({"schema": CAPABILITY_SCHEMA, "hosts": [entry]}, "probe")   # the planner accepts it
    return entry


def output_ratio_of(entry: dict[str, Any]) -> dict[int, float]:
    """A tail host's output matrix over its mean layer, per batch size."""
    return {int(k): entry["output_decode_s"][k] / entry["layer_decode_s"][k] for k in entry["layer_decode_s"]}


def _nearest(ratio: dict[int, float], rows: int) -> float | None:
    if not ratio:
        return None
    return ratio[min(ratio, key=lambda b: (abs(b - rows), b))]


def probe_of_capability(cap: Any) -> dict[str, Any]:
    """A worker's GetCapability (with ``measured``: it ran with --probe-budget-s) as the probe's
    own JSON, for :func:`capability_from_probe`; DgrError when the worker measured nothing."""
    if not cap.HasField("measured") or not cap.measured.decode:
        raise DgrError("the worker reports no measured cost",
                       hint="start it with --probe-budget-s 5 (or run `dgr worker probe` on its host)")
    m, ident = cap.measured, cap.identity
    return {"layers": ident.range.end - ident.range.start, "head": ident.head, "tail": ident.tail,
            "layer_start": ident.range.start, "layer_end": ident.range.end, "n_layer": ident.n_layer,
            "decode_s": {str(b.rows): b.step_seconds for b in m.decode},
            "decode_no_output_s": {str(b.rows): b.step_no_output_seconds for b in m.decode if b.step_no_output_seconds > 0},
            "prompt_s_per_token": m.prompt_seconds_per_token,
            "prompt_no_output_s_per_token": m.prompt_no_output_seconds_per_token,
            "duty": m.duty, "threads": m.threads, "backend": cap.runtime.backend, "seconds": m.probe_seconds,
            "skipped": [], "error": "", "fake": False, "from_cache": m.from_cache,
            "memory_budget_bytes": cap.capacity.memory_budget_bytes}


def _duty(probe: dict[str, Any]) -> float:
    """The probe's burst/sustained ratio; above 0.9 it is taken as a whole host (run-to-run noise
    on an unthrottled host reads 0.9-1.0), and a probe without one (an older worker) as 1."""
    d = probe.get("duty")
    if not isinstance(d, (int, float)) or not 0 < d <= 1:
        return 1.0
    return 1.0 if d > 0.9 else round(float(d), 3)


def host_memory_bytes(probe: dict[str, Any], memory_mb: float | None) -> int:
    """What the host lets a Shard use: --memory-mb, else the worker's budget (--memory-budget-mb
    or its cgroup's memory.max), else the host's MemAvailable."""
    if memory_mb:
        return int(memory_mb * (1 << 20))
    if int(probe.get("memory_budget_bytes") or 0) > 0:
        return int(probe["memory_budget_bytes"])
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemAvailable:"):
                return int(ln.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    raise DgrError("cannot tell this host's memory", hint="give --memory-mb")


def merge_capability(path: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """Adds ``entry`` to the capabilities file at ``path`` (created when missing), replacing a host
    of the same name and keeping the order of the others; written atomically."""
    doc: dict[str, Any] = {"schema": CAPABILITY_SCHEMA, "hosts": []}
    if path.exists():
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DgrError(f"cannot read {path}: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("hosts"), list):
            raise DgrError(f"{path} is not a capabilities file (schema {CAPABILITY_SCHEMA})")
    hosts = [h for h in doc["hosts"] if not (isinstance(h, dict) and h.get("name") == entry["name"])]
    at = next((i for i, h in enumerate(doc["hosts"]) if isinstance(h, dict) and h.get("name") == entry["name"]),
              len(hosts))
    hosts.insert(at, entry)
    doc["hosts"] = hosts
    doc.setdefault("schema", CAPABILITY_SCHEMA)
    parse_capabilities(doc, str(path))
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise DgrError(f"cannot write {path}: {exc.strerror}") from None
    return doc


def default_host_name() -> str:
    return socket.gethostname() or "host"


def capability_of(entry: dict[str, Any]) -> HostCapability:
    return parse_capabilities({"schema": CAPABILITY_SCHEMA, "hosts": [entry]})[0][0]
