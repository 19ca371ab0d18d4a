"""Route planning for unequal hosts: a cost model of a chained route and the split it suggests
(``dgr plan``; docs/multi-host.md, "Choosing a split").

Inputs:

- each host's **capability** for this model: what one of its layers costs per decode step at a
  few batch sizes, per prompt token, and what the output matrix and the token embedding cost,
  with the memory it may use (:class:`HostCapability`; a JSON file, see :func:`load_capabilities`);
- the **link** between consecutive hosts (round trip, bandwidth);
- the **model's shape** read from its GGUF (layers' weights, the output matrix, the KV cache per
  cell) (:func:`model_shape`);
- the **workload** (concurrent sessions, prompt length, context per session).

The cost model (:func:`predict`) is a pipeline of stages. A stage's time for a batch of ``b`` rows
is its layers' cost at ``b`` (each layer weighted by its share of the model's mean layer weights),
plus the output matrix on the tail and the embedding lookup on the head; each hop adds half a
round trip and the rows' bytes over the bandwidth. With ``G`` pipeline groups of ``b = S / G``
rows, one round (every session one token) takes ``max(cycle(b), G * slowest stage(b))``, where
``cycle(b)`` is one group's trip through every stage and back. A stage's busy share is its
``G * stage(b)`` over the round.

The planner (:func:`plan_route`) tries every subset of the hosts in every order up to 4 hosts
(which host is the tail matters: it holds the output matrix); beyond, in the listed order, all
of them, all but one or two, and each alone: for each, and each group count, a dynamic program finds the contiguous
ranges whose slowest stage is the least among those that fit every host's memory; the candidate
with the highest predicted aggregate decode wins, among those that keep a session's token
latency within the stated bound. A host left out is named with the reason (it does not fit, or
the route is faster without it).

Written here rather than taken from a library: the figures are dgr's own (its workers, its
wire format); the search is a few dozen lines of prefix sums."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from itertools import combinations, permutations
from pathlib import Path
from typing import Any, Sequence

from ..errors import DgrError
from .capabilities import (CAPABILITY_SCHEMA, MAX_HOSTS, HostCapability, Link,  # noqa: F401
                           _interpolate, _positive, load_capabilities, parse_capabilities)



@dataclass(frozen=True)
class Overheads:
    """What a route spends beside the layers: ``token_s`` per token on the head's host (the driver
    or gateway beside it, gRPC, sampling), ``step_s`` per group step through the route (the
    driver's round trip, scheduling), ``hop_s`` per hop a group step crosses (a frame sent and
    received between workers: CPU on both hosts, half on each). Defaults: measured on a 2-core VM
    with the Python driver pinned beside 1-thread SmolLM2-135M workers, one core each (the whole
    model alone: 12.1 and 66.3 ms per step at 1 and 8 sessions against 7.7 and 50.0 ms of probed
    compute; a 2-host route's hand-off 2.1 ms above the single host's)."""
    token_s: float = 0.0017
    step_s: float = 0.0027
    hop_s: float = 0.0021

    def validate(self) -> None:
        for what, v in (("token", self.token_s), ("step", self.step_s), ("hop", self.hop_s)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 10):
                raise DgrError(f"{what} overhead {v!r} s is not within 0..10 s")


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a model: per layer its weight elements (cost) and bytes
    (memory), the output matrix's and embedding's bytes, the KV cache per cell and layer, and the
    width of a boundary row."""
    name: str
    layer_elements: tuple[int, ...]
    layer_bytes: tuple[int, ...]
    output_bytes: int
    embed_bytes: int
    tied: bool                 # the output matrix is the embedding (head and tail both hold it)
    kv_bytes_per_cell_layer: int
    n_embd: int

    @property
    def n_layer(self) -> int:
        return len(self.layer_elements)

    @classmethod
    def uniform(cls, n_layer: int, *, layer_bytes: int, output_bytes: int, embed_bytes: int, n_embd: int,
                kv_bytes_per_cell_layer: int, tied: bool = False, name: str = "uniform") -> "ModelShape":
        return cls(name, (1,) * n_layer, (layer_bytes,) * n_layer, output_bytes, embed_bytes, tied,
                   kv_bytes_per_cell_layer, n_embd)


@dataclass(frozen=True)
class Workload:
    """Concurrent sessions, their prompt length, and the context each may use (KV cells)."""
    sessions: int = 8
    prompt_tokens: int = 512
    ctx_per_session: int = 2048

    def validate(self) -> None:
        if not 1 <= self.sessions <= 4096:
            raise DgrError(f"sessions {self.sessions} is not within 1..4096")
        if not 1 <= self.prompt_tokens <= 1 << 20:
            raise DgrError(f"prompt length {self.prompt_tokens} is not within 1..1048576 tokens")
        if not 1 <= self.ctx_per_session <= 1 << 20:
            raise DgrError(f"context {self.ctx_per_session} is not within 1..1048576 cells")


@dataclass
class StagePlan:
    host: str
    layers: tuple[int, int]
    decode_s: float            # this stage's compute for one group's batch
    decode_1_s: float          # the same for one row (a session alone)
    prefill_s: float           # one prompt through this stage
    busy_share: float
    memory_bytes: int
    memory_budget_bytes: int


@dataclass
class Prediction:
    groups: int
    rows_per_group: int
    aggregate_tok_s: float     # every session together
    session_tok_s: float       # one session's rate under this load
    single_session_tok_s: float  # a session alone on the route
    token_latency_s: float     # one session's time between tokens under this load
    ttft_s: float              # one prompt alone
    ttft_all_s: float          # the last of `sessions` prompts arriving together
    round_s: float
    stages: list[StagePlan]


@dataclass
class Plan:
    split: str                 # "A:B,B:C" in stage order
    hosts: list[str]
    prediction: Prediction
    latency_bound_s: float
    dropped: list[dict[str, str]] = field(default_factory=list)
    candidates: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"split": self.split, "hosts": self.hosts, "latency_bound_s": self.latency_bound_s,
                "dropped": self.dropped, "candidates": self.candidates, "prediction": asdict(self.prediction)}


# ---------------------------------------------------------------- the model's shape


def model_shape(path: Path) -> ModelShape:
    """The shape of a GGUF (a single file or any part of a split set); DgrError when unreadable."""
    from ..gguf.gguf_set import open_model
    from ..gguf.inspect import layer_of

    try:
        with open_model(path) as gf:
            n_layer = int(gf.n_layer)
            n_embd = int(gf.hparam("embedding_length"))
            n_head = int(gf.hparam("attention.head_count", 1) or 1)
            n_head_kv = gf.hparam("attention.head_count_kv", n_head)
            n_head_kv = int(max(n_head_kv) if isinstance(n_head_kv, (list, tuple)) else n_head_kv)
            k_len = int(gf.hparam("attention.key_length", n_embd // max(1, n_head)))
            v_len = int(gf.hparam("attention.value_length", k_len))
            elems, nbytes = [0] * n_layer, [0] * n_layer
            for t in gf.tensors:
                i = layer_of(t.name)
                if i is not None and i < n_layer:
                    elems[i] += t.n_elements
                    nbytes[i] += t.n_bytes
            tied = not gf.has_tensor("output.weight")
            embed = gf.tensor("token_embd.weight").n_bytes if gf.has_tensor("token_embd.weight") else 0
            output = embed if tied else gf.tensor("output.weight").n_bytes
    except DgrError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DgrError(f"cannot read the model's shape from {path}: {exc}") from None
    if n_layer < 1 or not any(elems):
        raise DgrError(f"{path}: no layer tensors found")
    # f16 K and V per cell, per layer (llama.cpp's default cache type)
    kv = 2 * n_head_kv * (k_len + v_len)
    return ModelShape(Path(path).name, tuple(max(1, e) for e in elems), tuple(nbytes), output, embed, tied, kv, n_embd)


# ---------------------------------------------------------------- the cost model


class _Costs:
    """Prefix sums of one host's costs over the layers, at one batch size."""

    def __init__(self, model: ModelShape, host: HostCapability, rows: int) -> None:
        mean = sum(model.layer_elements) / model.n_layer
        per_row = host.layer_at(rows)
        self.dec = [0.0]
        self.pre = [0.0]
        self.dec1 = [0.0]
        per_1 = host.layer_at(1)
        for e in model.layer_elements:
            w = e / mean
            self.dec.append(self.dec[-1] + per_row * w)
            self.dec1.append(self.dec1[-1] + per_1 * w)
            self.pre.append(self.pre[-1] + host.layer_prefill_s * w)


def _stage_memory(model: ModelShape, a: int, b: int, workload: Workload, prefix: Sequence[int] | None = None) -> int:
    weights = prefix[b] - prefix[a] if prefix is not None else sum(model.layer_bytes[a:b])
    if a == 0:
        weights += model.embed_bytes
    if b == model.n_layer and not (model.tied and a == 0):
        weights += model.output_bytes
    kv = workload.sessions * workload.ctx_per_session * model.kv_bytes_per_cell_layer * (b - a)
    # compute buffers: a batch of rows through the widest matrices; llama.cpp's own estimate is
    # exact only at load, so a margin of a tenth of the weights stands in for it here
    return int(weights + kv + weights // 10)


def predict(model: ModelShape, hosts: Sequence[HostCapability], ranges: Sequence[tuple[int, int]], link: Link,
            workload: Workload, groups: int = 1, overheads: Overheads = Overheads(),
            gateway: str | None = None) -> Prediction:
    """The cost model's figures for ``hosts[k]`` serving ``ranges[k]`` (contiguous, covering every
    layer) with ``groups`` pipeline groups. ``gateway``: the host the driver or gateway runs on
    (its per-token share is that host's CPU; a host outside the route: none of the stages');
    None: the head's."""
    if len(hosts) != len(ranges) or not hosts:
        raise DgrError("one layer range per host")
    if ranges[0][0] != 0 or ranges[-1][1] != model.n_layer or \
            any(r0[1] != r1[0] for r0, r1 in zip(ranges, ranges[1:])) or any(a >= b for a, b in ranges):
        raise DgrError(f"ranges {ranges} do not cover 0:{model.n_layer} contiguously")
    # a single Shard batches every ready row: groups exist only between stages
    groups = 1 if len(hosts) == 1 else max(1, min(groups, workload.sessions))
    rows = math.ceil(workload.sessions / groups)
    row_bytes = 4 * model.n_embd
    stages, dec, dec1, pre = [], [], [], []
    for k, (h, (a, b)) in enumerate(zip(hosts, ranges)):
        c = _Costs(model, h, rows)
        d, d1, p = c.dec[b] - c.dec[a], c.dec1[b] - c.dec1[a], workload.prompt_tokens * (c.pre[b] - c.pre[a])
        if a == 0:
            d, d1 = d + h.embed_s, d1 + h.embed_s
        if b == model.n_layer:
            d, d1 = d + h.output_at(rows), d1 + h.output_at(1)
            p += h.output_prefill_s
        dec.append(d)
        dec1.append(d1)
        pre.append(p)
        stages.append(StagePlan(h.name, (a, b), d, d1, p, 0.0, _stage_memory(model, a, b, workload), h.memory_bytes))
    # the gateway's host also runs the driver (or gateway) for its rows; each hop costs both its
    # ends some CPU (half its overhead each)
    gw = 0 if gateway is None else next((k for k, h in enumerate(hosts) if h.name == gateway), -1)
    if gw >= 0:
        dec[gw] += rows * overheads.token_s
        dec1[gw] += overheads.token_s
    outside = (rows * overheads.token_s, overheads.token_s) if gw < 0 else (0.0, 0.0)
    hops = len(hosts) - 1
    for k in range(len(hosts)):
        ends = (k > 0) + (k < hops)
        dec[k] += ends * overheads.hop_s / 2
        dec1[k] += ends * overheads.hop_s / 2
        stages[k].decode_s, stages[k].decode_1_s = dec[k], dec1[k]
    back = link.hop_s(8 * rows) if hops else 0.0   # sampled tokens back to the head
    cycle = sum(dec) + hops * link.hop_s(rows * row_bytes) + back + overheads.step_s + outside[0]
    cycle1 = sum(dec1) + (hops * link.hop_s(row_bytes) + link.hop_s(8) if hops else 0.0) + overheads.step_s + \
        outside[1]
    # a host kept busy computes only its duty share of the time (bursts run at full speed); hosts
    # sharing cores add their stages up on them
    def busiest(ds: Sequence[float]) -> float:
        load: dict[str, float] = {}
        for k, (d, h) in enumerate(zip(ds, hosts)):
            key = h.core or f"\0{k}"
            load[key] = load.get(key, 0.0) + d / h.duty
        return max(load.values())
    cycle1 = max(cycle1, busiest(dec1))
    round_s = max(cycle, groups * busiest(dec))
    for s, d in zip(stages, dec):
        s.busy_share = min(1.0, groups * d / round_s)
    prompt_hop = link.hop_s(workload.prompt_tokens * row_bytes) if hops else 0.0
    ttft = sum(pre) + hops * prompt_hop + back
    # prompts arriving together flow through the stages one after another (no chunked overlap)
    ttft_all = ttft + (workload.sessions - 1) * max(max(pre), prompt_hop if hops else 0.0)
    return Prediction(groups=groups, rows_per_group=rows, aggregate_tok_s=workload.sessions / round_s,
                      session_tok_s=1.0 / round_s, single_session_tok_s=1.0 / cycle1, token_latency_s=round_s,
                      ttft_s=ttft, ttft_all_s=ttft_all, round_s=round_s, stages=stages)


# ---------------------------------------------------------------- the search


def _best_ranges(model: ModelShape, hosts: Sequence[HostCapability], rows: int, workload: Workload,
                 overheads: Overheads = Overheads(), total: bool = False,
                 gateway: int = 0) -> list[tuple[int, int]] | None:
    """Contiguous ranges (every host at least one layer) whose slowest stage at ``rows`` is the
    least (``total``: whose stages add up to the least, one group's trip), among those that fit
    each host's memory; a stage's time is its compute over its host's duty, the head's with the
    driver's share on host ``gateway`` (-1: none of them). None when none fits."""
    n, m = model.n_layer, len(hosts)
    if m > n:
        return None
    costs = [_Costs(model, h, rows) for h in hosts]
    inf = float("inf")
    prefix = [0]
    for x in model.layer_bytes:
        prefix.append(prefix[-1] + x)

    def stage(k: int, a: int, b: int) -> float:
        if _stage_memory(model, a, b, workload, prefix) > hosts[k].memory_bytes:
            return inf
        c = costs[k].dec[b] - costs[k].dec[a] + ((k > 0) + (k < m - 1)) * overheads.hop_s / 2
        if k == gateway:
            c += rows * overheads.token_s
        if a == 0:
            c += hosts[k].embed_s
        if b == n:
            c += hosts[k].output_at(rows)
        return c / hosts[k].duty

    best = [[inf] * (n + 1) for _ in range(m + 1)]
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for k in range(1, m + 1):
        for i in range(k, n - (m - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                c = best[k - 1][j] + stage(k - 1, j, i) if total else max(best[k - 1][j], stage(k - 1, j, i))
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    if best[m][n] == inf:
        return None
    cuts, i = [n], n
    for k in range(m, 0, -1):
        i = cut[k][i]
        cuts.append(i)
    cuts.reverse()
    return list(zip(cuts, cuts[1:]))


def plan_route(model: ModelShape, hosts: Sequence[HostCapability], link: Link, workload: Workload, *,
               latency_bound: float = 2.0,
               overheads: Overheads = Overheads()) -> Plan:
    """The split (and pipeline groups) with the highest predicted aggregate decode for
    ``workload``, over the subsets of ``hosts``: all, in every order, up to 4 hosts; beyond, in
    the listed order, all of them, all but one or two, and each alone. The plan's first host is
    the head; the first host listed runs the driver or gateway (its per-token share is counted on
    that host, or on none when the plan leaves it out).
    ``latency_bound``: a session's time between tokens under the load may be at most this many
    times the least any candidate offers for the same load (pipeline groups trade a session's
    latency for aggregate throughput; this caps the trade). DgrError when no subset of the hosts
    can hold the model."""
    for h in hosts:
        h.validate()
    link.validate()
    workload.validate()
    overheads.validate()
    if not hosts:
        raise DgrError("no hosts to plan for")
    if len(hosts) > MAX_HOSTS:
        raise DgrError(f"{len(hosts)} hosts; the planner takes at most {MAX_HOSTS}")
    if len({h.name for h in hosts}) != len(hosts):
        raise DgrError("host names must be distinct")
    if not (_positive(latency_bound) and latency_bound >= 1.0):
        raise DgrError(f"latency bound {latency_bound!r} must be a number >= 1")
    m = len(hosts)
    subsets: list[tuple[int, ...]] = []
    if m <= 4:
        for r in range(1, m + 1):
            for c in combinations(range(m), r):
                subsets.extend(permutations(c))
    else:   # more hosts, in the listed order: all of them, all but one, all but two, and each alone
        for r in (m, m - 1, m - 2, 1):
            subsets.extend(combinations(range(m), r))
    scored: list[tuple[Prediction, tuple[int, ...], list[tuple[int, int]]]] = []
    for sub in subsets:
        hs = [hosts[i] for i in sub]
        limit = 1 if len(hs) == 1 else min(workload.sessions, len(hs) + 1)
        seen: set[tuple[tuple[int, int], ...]] = set()
        gw = sub.index(0) if 0 in sub else -1   # the first listed host runs the gateway
        # one search per distinct batch size (group counts that give the same rows share it)
        found = [_best_ranges(model, hs, rows, workload, overheads, gateway=gw)
                 for rows in sorted({math.ceil(workload.sessions / g) for g in range(1, limit + 1)})]
        found.append(_best_ranges(model, hs, workload.sessions, workload, overheads, total=True, gateway=gw))
        for ranges in found:
            if ranges is None:
                continue
            for gg in range(1, limit + 1):   # the ranges found for one group count, at every count
                key = (tuple(ranges), gg)
                if key in seen:
                    continue
                seen.add(key)
                scored.append((predict(model, hs, ranges, link, workload, gg, overheads, hosts[0].name), sub, ranges))
    if not scored:
        need = _stage_memory(model, 0, model.n_layer, workload)
        raise DgrError(f"no subset of the {m} hosts holds {model.name} for {workload.sessions} sessions of "
                       f"{workload.ctx_per_session} cells (the whole model needs about {need / 2**30:.1f} GiB; "
                       f"the hosts offer {sum(h.memory_bytes for h in hosts) / 2**30:.1f} GiB together)")
    bound_s = latency_bound * min(p.token_latency_s for p, _, _ in scored)
    ok = [t for t in scored if t[0].token_latency_s <= bound_s * (1 + 1e-9)]
    # the highest aggregate; then fewer hosts; then the lower token latency; then the listed order
    pred, sub, ranges = max(ok, key=lambda t: (round(t[0].aggregate_tok_s, 9), -len(t[1]),
                                               -round(t[0].token_latency_s, 12), t[1] == tuple(sorted(t[1]))))
    dropped = []
    for i, h in enumerate(hosts):
        if i in sub:
            continue
        with_it = [t for t in scored if i in t[1] and set(sub) <= set(t[1])]
        if not any(i in t[1] for t in scored):
            why = "it cannot hold any layer range of this route within its memory"
        elif not with_it:
            why = "no route with it and the chosen hosts fits every host's memory"
        else:
            b = max(with_it, key=lambda t: t[0].aggregate_tok_s)
            alt = ", ".join(f"{hosts[j].name} {a}:{c}" for j, (a, c) in zip(b[1], b[2]))
            if b[0].aggregate_tok_s <= pred.aggregate_tok_s:
                why = (f"the route is faster without it: {pred.aggregate_tok_s:.1f} tok/s against "
                       f"{b[0].aggregate_tok_s:.1f} with it ({alt})")
            else:
                why = (f"with it the route would reach {b[0].aggregate_tok_s:.1f} tok/s ({alt}), but a session "
                       f"would wait {b[0].token_latency_s * 1e3:.1f} ms per token, over the "
                       f"{bound_s * 1e3:.1f} ms bound")
        dropped.append({"host": h.name, "why": why})
    return Plan(split=",".join(f"{a}:{b}" for a, b in ranges), hosts=[hosts[i].name for i in sub],
                prediction=pred, latency_bound_s=bound_s, dropped=dropped, candidates=len(scored))


def even_ranges(n_layer: int, n: int) -> list[tuple[int, int]]:
    cuts = [round(i * n_layer / n) for i in range(n + 1)]
    return list(zip(cuts, cuts[1:]))
