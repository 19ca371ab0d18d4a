"""The Tracker side for workers that already run (on other hosts): read each worker's capability
over (m)TLS, build its registration (:mod:`meshnet_adapter.registration`) and form routes
(:mod:`meshnet_adapter.routing`).

    python -m meshnet_adapter.coverage --model GGUF --node h1=198.18.7.2:40001 --node h2=198.18.7.3:40002 \\
        --tls-ca ca.pem --tls-cert client.pem --tls-key client.key

prints JSON: ``{"registrations": [...], "refused": [...], "routes": [[node, …], …] | null,
"ranking": {"by", "notes", "predicted_tok_s": [per route]} | null, "no_route": [reason, …] | null}``.
A worker whose fingerprint differs from the recipe of ``--model``, or that reports an absurd
measured cost, is refused (listed, never registered). Workers started with ``--probe-budget-s``
report their measured cost; when every candidate's Shards do, routes are ranked by the cost
model over ``--model``'s shape (:func:`meshnet_adapter.routing.form_routes`). Exit 0 when at
least one route formed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dgr.errors import DgrError

from .registration import Capacity, ShardRegistration, make_registration, measurement_of_capability
from .routing import NoRoute, form_routes


def register(nodes: list[tuple[str, str]], model: Path, *, backend: str = "cpu", tls=None,
             timeout: float = 10.0) -> tuple[list[ShardRegistration], list[dict]]:
    from dgr.gguf.recipe import load_registry, recipe_for
    from dgr.protocol.client import WorkerClient, WorkerError

    recipe = recipe_for(model, backend=backend, progress=False)
    registry = load_registry()
    regs, refused = [], []
    for node_id, ep in nodes:
        try:
            with WorkerClient(ep, timeout=timeout, tls=tls) as c:
                cap = c.capability()
                load = c.load()
        except WorkerError as exc:
            refused.append({"node": node_id, "endpoint": ep, "reason": f"unreachable: {exc}"})
            continue
        ident = cap.identity
        if ident.compatibility_fingerprint != recipe.fingerprint():
            refused.append({"node": node_id, "endpoint": ep, "reason": f"fingerprint {ident.compatibility_fingerprint[:12]} "
                            f"is not the recipe's {recipe.fingerprint()[:12]}"})
            continue
        try:
            regs.append(make_registration(
                node_id=node_id, endpoint=ep, recipe=recipe, architecture=ident.architecture, n_layer=ident.n_layer,
                start=ident.range.start, end=ident.range.end, registry=registry,
                capacity=Capacity(max_sessions=cap.capacity.max_sessions, active_sessions=load.active_sessions,
                                  kv_cells_total=load.kv_cells_total, kv_cells_used=load.kv_cells_used,
                                  max_batch_tokens=cap.capacity.max_batch_tokens),
                measured=measurement_of_capability(cap)))
        except DgrError as exc:
            refused.append({"node": node_id, "endpoint": ep, "reason": exc.one_line()})
    return regs, refused


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshnet_adapter.coverage", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the GGUF the workers serve (its recipe)")
    p.add_argument("--node", action="append", required=True, metavar="NAME=HOST:PORT")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--tls-ca", type=Path)
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    a = p.parse_args(argv)
    try:
        from dgr.protocol.tls import TlsFiles

        nodes = []
        for n in a.node:
            name, sep, ep = n.partition("=")
            if not sep or not name or not ep:
                raise DgrError(f"--node {n!r}: expected NAME=HOST:PORT")
            nodes.append((name, ep))
        tls = TlsFiles(a.tls_ca, a.tls_cert, a.tls_key) if a.tls_ca else None
        regs, refused = register(nodes, a.model, backend=a.backend, tls=tls)
    except DgrError as exc:
        print(f"coverage: error: {exc.one_line()}", file=sys.stderr)
        return 1
    shape = None
    if any(r.measured is not None for r in regs):   # the cost model needs the model's shape
        from dgr.route.planner import model_shape

        try:
            shape = model_shape(a.model)
        except DgrError as exc:   # ranked without it; the routes' notes say so
            print(f"coverage: note: {exc.one_line()}", file=sys.stderr)
    routes = form_routes(regs, regs[0].artifact_id, model=shape) if regs else NoRoute("", ("no worker registered",))
    doc = {"registrations": [r.to_json() for r in regs], "refused": refused,
           "routes": None if isinstance(routes, NoRoute) else
           [[{"node": s.node_id, "endpoint": s.endpoint, "range": [s.start, s.end], "fingerprint": s.fingerprint,
              "certified": s.certified} for s in r.shards] for r in routes],
           "ranking": None if isinstance(routes, NoRoute) else
           {"by": routes.ranked_by, "notes": list(routes.notes),
            "predicted_tok_s": [r.predicted_tok_s for r in routes]},
           "no_route": list(routes.reasons) if isinstance(routes, NoRoute) else None}
    print(json.dumps(doc, indent=1, sort_keys=True))
    return 0 if doc["routes"] else 2


if __name__ == "__main__":
    sys.exit(main())
