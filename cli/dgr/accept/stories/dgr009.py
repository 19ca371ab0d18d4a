"""DGR-009: the native worker behind Meshnet's model-backend surface (``meshnet_adapter``).

Meshnet itself is not in this repository. What stands in for it here, named as such in every
detail: the Tracker is ``python -m meshnet_adapter.coverage`` (reads each worker's capability,
builds its registration, forms routes), Meshnet's relay is ``dgr.protocol.relay.LoopbackRelay``
(a dumb byte pump that cuts the stream into 1000-byte pieces) in front of a ``RelayBridge`` per
worker, and the node service's backend contract is the ``ShardBackend`` protocol class in
``meshnet_adapter/backend.py``. ``dgr`` never imports ``meshnet_adapter`` (it sits on top), so this
story reads the adapter's source as text and runs it as a program or through its tests.

Live part, on the story's model (SmolLM2-135M by default): a head worker and a tail worker (one
range each, 4 sessions of 512 cells) and a fake-model worker; the stand-in Tracker registers them,
forms the route, and the route then runs direct (gRPC streams), through the relay, and with one
session cancelled, its telemetry checked against the Tracker's route.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import sys
import tomllib

from ... import paths
from ..evidence import StoryContext, story
from ._common import left_on_workers, tests_criterion

T = "tests/"
MAX_SESSIONS = 4
CTX = 512
N_TOKENS = 12
# projects that must never become a core dependency (PEP 503-normalised distribution / top-level module names)
FORBIDDEN = {"vllm", "nakshatra", "prima", "prima-cpp", "primacpp", "prima_cpp", "petals", "hivemind", "ray",
             "exo", "mesh-llm", "mesh_llm", "sglang", "tensorrt-llm", "tensorrt_llm"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _forbidden(name: str) -> bool:
    n = _norm(name)
    return n in {_norm(f) for f in FORBIDDEN} or n.startswith(("vllm-", "nakshatra", "prima-cpp"))


def _methods(tree: ast.Module, cls: str) -> dict[str, ast.arguments]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {f.name: f.args for f in node.body if isinstance(f, ast.FunctionDef)}
    return {}


def _surface(ctx: StoryContext) -> None:
    """GgufShardBackend defines every method of the ShardBackend protocol with its parameters
    (extra ones only with defaults); the adapter imports neither torch nor transformers."""
    adapter = paths.repo_root() / "meshnet_adapter"
    tree = ast.parse((adapter / "backend.py").read_text())
    proto, impl = _methods(tree, "ShardBackend"), _methods(tree, "GgufShardBackend")
    problems = []
    for name, args in proto.items():
        if name not in impl:
            problems.append(f"{name} missing")
            continue
        want = [a.arg for a in args.args + args.kwonlyargs]
        ia = impl[name]
        got = [a.arg for a in ia.args + ia.kwonlyargs]
        defaults = {a.arg for a in ia.args[len(ia.args) - len(ia.defaults):]} if ia.defaults else set()
        defaults |= {a.arg for a, d in zip(ia.kwonlyargs, ia.kw_defaults) if d is not None}
        if [g for g in got if g in want] != want:
            problems.append(f"{name}({', '.join(got)}) is not ({', '.join(want)})")
        extra = [g for g in got if g not in want and g not in defaults]
        if extra:
            problems.append(f"{name} requires {', '.join(extra)} beyond the protocol")
    heavy = []
    for f in sorted(adapter.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            heavy += [f"{f.name}: {m}" for m in mods if m.split(".")[0] in ("torch", "transformers")
                      or m.startswith("dgr.bench")]
    ctx.record_command("ast of meshnet_adapter/*.py: ShardBackend vs GgufShardBackend methods; torch/transformers imports")
    ctx.check("the adapter implements the existing model-backend surface (every ShardBackend method, same "
              "parameters) and imports neither torch nor transformers (the Transformers backend is left as it is)",
              bool(proto) and not problems and not heavy,
              "; ".join(problems + heavy) or f"GgufShardBackend defines all {len(proto)} ShardBackend methods "
              f"({', '.join(proto)}) with their parameters; 0 torch/transformers/dgr.bench imports in "
              f"{len(list(adapter.rglob('*.py')))} adapter modules")


def _no_core_dependency(ctx: StoryContext) -> None:
    root = paths.repo_root()
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    deps = [re.split(r"[\s<>=!~;\[(]", d, maxsplit=1)[0] for d in project.get("dependencies", [])]
    try:
        from importlib import metadata

        installed = [re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0] for r in (metadata.requires("dgr") or [])
                     if "extra ==" not in r]
    except Exception:   # not installed as a distribution: pyproject is the list
        installed = []
    imports: set[str] = set()
    for base in (root / "cli" / "dgr", root / "meshnet_adapter"):
        for f in base.rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    imports |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    imports.add(node.module.split(".")[0])
    cmake_text = "\n".join(p.read_text(errors="replace") for p in (root / "worker").rglob("CMakeLists.txt"))
    cmake = set(re.findall(r"(?:find_package|FetchContent_Declare|ExternalProject_Add)\s*\(\s*([A-Za-z0-9_.\-]+)",
                           cmake_text))
    bad = sorted({f"pyproject:{d}" for d in deps if _forbidden(d)} | {f"installed dgr requires:{d}" for d in installed
                 if _forbidden(d)} | {f"import:{m}" for m in imports if _forbidden(m)}
                 | {f"worker cmake:{c}" for c in cmake if _forbidden(c)})
    ctx.results["core_dependencies"] = {"pyproject": deps, "installed_requires": installed,
                                        "top_level_imports": sorted(imports), "worker_cmake_packages": sorted(cmake)}
    ctx.record_command("pyproject.toml [project].dependencies, importlib.metadata.requires('dgr'), imports of "
                       "cli/dgr + meshnet_adapter (ast), find_package/FetchContent in worker/**/CMakeLists.txt")
    ctx.check("no vLLM, Nakshatra, prima.cpp or other engine control plane is a core dependency",
              bool(deps) and bool(imports) and not bad,
              "found: " + ", ".join(bad) if bad else
              f"{len(deps)} core dependencies ({', '.join(deps)}), {len(installed)} installed requirement(s), "
              f"{len(imports)} top-level modules imported by dgr/meshnet_adapter, worker CMake packages "
              f"({', '.join(sorted(cmake)) or 'none'}): none is one of {', '.join(sorted(FORBIDDEN))}")


def _coverage(ctx: StoryContext, nodes: list[tuple[str, str]]) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "meshnet_adapter.coverage", "--model", str(ctx.model), "--backend", ctx.backend]
    for name, ep in nodes:
        cmd += ["--node", f"{name}={ep}"]
    p = ctx.command(cmd, cwd=paths.repo_root(), timeout=120)
    try:
        return p.returncode, json.loads(p.stdout)
    except json.JSONDecodeError:
        return p.returncode, {"error": (p.stderr or p.stdout).strip()[-300:]}


async def _drive(direct: list[str], bridges_for: list[str], prompt: str) -> dict:
    """One session direct, the same through the stand-in relay, and one cancelled session."""
    from ...protocol.relay import LoopbackRelay, RelayBridge
    from ...route.driver import RouteDriver, Sampling

    greedy = Sampling(ignore_eog=True)
    out: dict = {}
    d = await RouteDriver(direct).connect()
    try:
        toks = await d.tokenize(prompt, add_special=True)
        out["direct"] = await d.generate(toks, max_tokens=N_TOKENS, sampling=greedy, stop_on_eog=False,
                                         session_id="dgr009-direct")
        out["mode"] = d.mode
        seen = asyncio.Event()
        n = {"c": 0}

        def tick(_t):
            n["c"] += 1
            if n["c"] >= 3:
                seen.set()
        task = asyncio.create_task(d.generate(toks, max_tokens=400, sampling=greedy, stop_on_eog=False,
                                              session_id="dgr009-cancel", on_token=tick))
        await asyncio.wait_for(seen.wait(), 60)
        out["cancel_held"] = await d.cancel("dgr009-cancel")
        out["cancelled"] = await asyncio.wait_for(task, 60)
    finally:
        await d.close()
    bridges = [await RelayBridge(ep).start() for ep in bridges_for]
    relays = [await LoopbackRelay(b.address).start() for b in bridges]
    try:
        r = await RouteDriver([x.endpoint for x in relays]).connect()
        try:
            out["relayed"] = await r.generate(toks, max_tokens=N_TOKENS, sampling=greedy, stop_on_eog=False,
                                              session_id="dgr009-relayed")
            out["relay_mode"] = r.mode
        finally:
            await r.close()
        out["relay_bytes"] = [(x.bytes_up, x.bytes_down) for x in relays]
        out["bridge_frames"] = [b.frames_forwarded for b in bridges]
        out["relay_endpoints"] = [x.endpoint for x in relays]
    finally:
        for x in relays:
            await x.close()
        for b in bridges:
            await b.close()
    return out


def _live(ctx: StoryContext) -> None:
    from ...gguf.recipe import load_registry, recipe_for
    from ...route.local import ensure_worker
    from ...route.planner import model_shape
    from ...route.supervisor import WorkerArgs, WorkerProcess

    assert ctx.model is not None
    recipe = recipe_for(ctx.model, backend=ctx.backend, progress=False)
    certified = load_registry().routable(recipe)
    n_layer = model_shape(ctx.model).n_layer
    mid = n_layer // 2
    common = dict(model=ctx.model, threads=1, max_sessions=MAX_SESSIONS, ctx_per_session=CTX)
    exe = ensure_worker(ctx.backend)
    ctx.record_command(f"dgr-worker serve --model {ctx.model.name} --layers 0:{mid} | {mid}:{n_layer} --threads 1 "
                       f"--max-sessions {MAX_SESSIONS} --ctx-per-session {CTX}; dgr-worker serve --fake-model")
    with WorkerProcess.start(WorkerArgs(layers=(0, mid), **common), binary=exe) as head, \
            WorkerProcess.start(WorkerArgs(layers=(mid, n_layer), **common), binary=exe) as tail, \
            WorkerProcess.start(WorkerArgs(fake_model=True, n_layer=n_layer, layers=(mid, n_layer)), binary=exe) as fake:
        served = {"head": (head.target, 0, mid), "tail": (tail.target, mid, n_layer)}
        rc, doc = _coverage(ctx, [("head", head.target), ("tail", tail.target), ("fake", fake.target)])
        ctx.attach("coverage.json", json.dumps(doc, indent=1, sort_keys=True) + "\n")
        regs = {r["node_id"]: r for r in doc.get("registrations", [])}
        problems = []
        for node, (ep, a, b) in served.items():
            r = regs.get(node)
            if r is None:
                problems.append(f"{node} not registered")
                continue
            got = (r["endpoint"], r["start"], r["end"], r["fingerprint"], r["artifact_id"], r["recipe"]["backend"],
                   r["capacity"]["max_sessions"])
            want = (ep, a, b, recipe.fingerprint(), recipe.artifact_id, ctx.backend, MAX_SESSIONS)
            if got != want or r["capacity"]["kv_cells_total"] <= 0 or r["certified"] != certified:
                problems.append(f"{node}: {got}, kv {r['capacity']['kv_cells_total']}, certified {r['certified']}; "
                                f"expected {want}, kv > 0, certified {certified}")
        refused = {x["node"]: x["reason"] for x in doc.get("refused", [])}
        if "fingerprint" not in refused.get("fake", ""):
            problems.append(f"the fake-model worker was not refused for its fingerprint: {refused.get('fake')!r}")
        h = regs.get("head", {})
        ctx.check("(live, stand-in Tracker `python -m meshnet_adapter.coverage`) registration carries the exact "
                  "validated GGUF recipe, the Shard, the backend and the concurrency/KV capacity",
                  rc in (0, 2) and not problems,
                  "; ".join(problems) or f"head [0:{mid}) and tail [{mid}:{n_layer}) registered with fingerprint "
                  f"{recipe.fingerprint()[:12]} = recipe_for({ctx.model.name}), artifact {recipe.artifact_id[:12]}, "
                  f"backend {ctx.backend}, max_sessions {MAX_SESSIONS}, kv_cells_total "
                  f"{[regs[n]['capacity']['kv_cells_total'] for n in served]}, kv_dtype {h['recipe']['kv_dtype']}, "
                  f"kv_layout {h['recipe']['kv_layout']}, certified {certified}; fake worker refused: {refused['fake']}")
        routes = doc.get("routes") or []
        want_route = [["head", [0, mid]], ["tail", [mid, n_layer]]]
        got_routes = [[[s["node"], s["range"]] for s in r] for r in routes]
        rc_gap, gap = _coverage(ctx, [("head", head.target)])
        gap_reasons = gap.get("no_route") or []
        if certified:
            formed = rc == 0 and got_routes == [want_route] and all(s["certified"] for s in routes[0])
        else:   # a dark recipe: registered, never routed, and the reason says so
            formed = rc == 2 and not routes and any("dark" in x for x in doc.get("no_route") or [])
        incomplete = rc_gap == 2 and not gap.get("routes") and any(f"[{mid}:{n_layer})" in x for x in gap_reasons)
        ctx.check("(live, stand-in Tracker) only complete compatible routes form: head + tail is the one route, the "
                  "foreign-fingerprint worker is left out, a head alone forms none",
                  formed and incomplete,
                  f"exit {rc}, routes {got_routes} (recipe certified: {certified}; no_route {doc.get('no_route')}); "
                  f"head alone: exit {rc_gap}, no_route {gap_reasons}")
        if not (certified and formed):
            ctx.limitation("The live relay and correlation runs were skipped: no route formed for "
                           f"{ctx.model.name} (recipe certified: {certified}); the tests above still cover them.")
            return
        eps = [served["head"][0], served["tail"][0]]
        prompt = "Relays move bytes, not meaning."
        ctx.record_command(f"RouteDriver({eps}) direct, cancelled, and via RelayBridge + LoopbackRelay (stand-in relay)")
        out = asyncio.run(_drive(eps, eps, prompt))
        left = left_on_workers(eps)
    d, rl, c = out["direct"], out["relayed"], out["cancelled"]
    ctx.results["live"] = {"mode": out["mode"], "relay_mode": out["relay_mode"], "tokens": d.tokens,
                           "relayed_tokens": rl.tokens, "relay_bytes": out["relay_bytes"],
                           "bridge_frames": out["bridge_frames"], "direct_telemetry": d.telemetry.to_json(),
                           "cancelled_telemetry": c.telemetry.to_json(), "left_after": left}
    ctx.check("(live, stand-in relay `LoopbackRelay` + `RelayBridge`) the route runs direct over gRPC streams and "
              "relayed as the same protobuf frames carried as opaque bytes, with the same tokens",
              d.error is None and rl.error is None and rl.tokens == d.tokens and len(d.tokens) == N_TOKENS
              and all(u > 0 and w > 0 for u, w in out["relay_bytes"]) and all(f > 0 for f in out["bridge_frames"])
              and all(e.startswith("relay+tcp://") for e in out["relay_endpoints"]),
              f"direct ({out['mode']}) {len(d.tokens)} tokens {d.tokens}; relayed ({out['relay_mode']}) "
              f"{len(rl.tokens)} tokens, {'identical' if rl.tokens == d.tokens else 'DIFFERENT'}; relay bytes "
              f"up/down per hop {out['relay_bytes']}, frames forwarded by the bridges {out['bridge_frames']}")
    route = [f"{ep}[{a}:{b})" for ep, a, b in served.values()]
    t, tc = d.telemetry, c.telemetry
    nodes = [n.node for n in t.nodes]
    ok = (t.session_id == "dgr009-direct" and t.request_id and t.status == "completed" and t.route == route
          and nodes == route and all(n.steps > 0 for n in t.nodes) and t.completion_tokens == len(d.tokens)
          and tc.session_id == "dgr009-cancel" and tc.status == "cancelled" and tc.request_id != t.request_id
          and any(out["cancel_held"]) and 0 < len(c.tokens) < 400 and all(x == (0, 0) for x in left))
    ctx.check("(live) request/work ids, cancellation, Generation Telemetry and per-node attribution stay correlated "
              "with the Tracker's route",
              ok, f"completed: request {t.request_id}, session {t.session_id}, status {t.status}, route {t.route} "
                  f"(Tracker route {route}), per node steps {[n.steps for n in t.nodes]} busy_s "
                  f"{[round(n.busy_s, 3) for n in t.nodes]}, {t.completion_tokens} tokens; cancelled: request "
                  f"{tc.request_id}, status {tc.status} after {len(c.tokens)} tokens, held per shard "
                  f"{out['cancel_held']}; (sessions, KV cells) left per worker {left}")


@story("DGR-009", "Integrate the native worker with Meshnet", lane="local-real", needs_model=True)
def run(ctx: StoryContext) -> None:
    from ...route.local import ensure_worker

    ensure_worker(ctx.backend)
    _surface(ctx)
    tests_criterion(ctx, "the GGUF Shard backend runs a route step by step over supervised workers "
                         "(load, open_session, step, release, telemetry, health, restart)",
                    [T + "test_route_backend.py::test_two_backends_run_a_route_step_by_step_and_attribute_work",
                     T + "test_route_backend.py::test_supervisor_restarts_a_dead_worker_and_fails_its_sessions"])
    tests_criterion(ctx, "registration carries the exact validated GGUF recipe, Shard, backend and capacity; the "
                         "Tracker recomputes fingerprint and certification from a payload",
                    [T + "test_routing.py::test_registration_payload_carries_validated_recipe",
                     T + "test_device_registry.py::test_registration_carries_the_device_class_and_certified_honours_it",
                     T + "test_meshnet_routing_plan.py::test_a_registration_with_its_measurement_round_trips_through_json",
                     T + "test_meshnet_routing_plan.py::test_an_absurd_measurement_in_a_payload_is_refused",
                     T + "test_route_real.py::test_backend_registers_the_exact_recipe_and_forms_a_route"], real=True)
    tests_criterion(ctx, "the Tracker forms only complete, contiguous, compatible routes with free capacity and keeps "
                         "uncertified (dark) recipes out, saying why",
                    [T + "test_routing.py::test_complete_contiguous_routes_best_first",
                     T + "test_routing.py::test_gap_is_explained",
                     T + "test_routing.py::test_fingerprint_mismatch_never_combines",
                     T + "test_routing.py::test_dark_recipe_never_routable",
                     T + "test_routing.py::test_capacity_exhausted_is_explained",
                     T + "test_meshnet_failover.py::test_tracker_finder_says_why_no_route",
                     T + "test_meshnet_failover.py::test_tracker_finder_keeps_the_current_shards_and_skips_failed"])
    tests_criterion(ctx, "direct routes use gRPC session streams; relayed routes carry the same versioned protobuf "
                         "frames as opaque bytes through the relay seam (errors and status included)",
                    [T + "test_protocol_client.py::test_driver_streams_are_the_protocol_stream",
                     T + "test_routing.py::test_relay_carries_protobuf_frames_as_opaque_bytes",
                     T + "test_routing.py::test_relay_rejects_oversized_frames",
                     T + "test_route_relay.py::test_relayed_route_gives_the_direct_routes_tokens",
                     T + "test_route_relay.py::test_relay_carries_structured_errors_and_status",
                     T + "test_route_relay.py::test_every_unary_rpc_of_the_service_goes_through_the_relay"])
    tests_criterion(ctx, "request/work ids, cancellation, Generation Telemetry, work records (billing) and per-node "
                         "attribution stay correlated, through cancellation and failover",
                    [T + "test_route_backend.py::test_cancel_session_is_attributed_as_cancelled",
                     T + "test_route_driver.py::test_cancel_one_session_others_continue",
                     T + "test_failover.py::test_route_sessions_with_standby_report_work_records",
                     T + "test_failover.py::test_cancel_through_the_failover_router_is_not_restarted",
                     T + "test_meshnet_failover.py::test_failover_through_the_tracker_finder"])
    _live(ctx)
    _no_core_dependency(ctx)
    tests_criterion(ctx, "the core runtime (dgr) never imports the Meshnet adapter; no import cycles",
                    [T + "test_layering.py::test_dgr_never_imports_meshnet_adapter",
                     T + "test_layering.py::test_no_import_cycles"])
    ctx.limitation("Meshnet is not in this repository. Stand-ins: the Tracker is `python -m meshnet_adapter.coverage` "
                   "(registration + route formation over running workers), Meshnet's relay is "
                   "dgr.protocol.relay.LoopbackRelay (a byte pump) in front of a RelayBridge per worker, and the node "
                   "service's backend contract is the ShardBackend protocol class in meshnet_adapter/backend.py.")
    ctx.limitation("Meshnet's own Transformers backend is not here, so 'unchanged Transformers behaviour' is shown "
                   "only as: the adapter implements the same surface and imports neither torch nor transformers; "
                   "the Transformers shard worker tests (tests/test_hf_worker.py) need the baseline extra"
                   + (" (installed)." if _has_baseline() else ", not installed here."))
    ctx.limitation("Billing is represented by the work records and Generation Telemetry dgr emits (per session, per "
                   "attempt, per Shard); no billing system consumes them here.")


def _has_baseline() -> bool:
    import importlib.util

    return bool(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"))
