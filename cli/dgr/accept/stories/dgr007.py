"""DGR-007: isolated concurrent local Hot KV State — the worker tests that pin each rule, and a
live check on the embedded SmolLM2: KV is allocated only for owned layers (the shards' KV
budgets add up to the whole model's)."""

from __future__ import annotations

from ..evidence import StoryContext, story
from ... import paths
from ._common import command_criterion, tests_criterion

T = "tests/"


@story("DGR-007", "Isolated concurrent local Hot KV State", lane="local-real", needs_model=True)
def run(ctx: StoryContext) -> None:
    from ...protocol.client import WorkerClient

    from ...route.local import LocalRoute, ensure_worker

    assert ctx.model is not None
    tests_criterion(ctx, "(Route Session ID, route epoch) maps to an isolated llama sequence; stale epochs and "
                         "incompatible cache expectations are rejected with their reasons",
                    [T + "test_worker_fake.py::test_error_cases_leave_the_session_and_others_intact",
                     T + "test_worker_fake.py::test_eight_concurrent_sessions_match_alone",
                     T + "test_admission.py::test_each_mismatch_is_rejected_with_its_reason"])
    ensure_worker(ctx.backend)
    with LocalRoute(ctx.model, [(0, 15), (15, 30)], threads=1, max_sessions=4, ctx_per_session=512) as r, \
            LocalRoute(ctx.model, [(0, 30)], threads=1, max_sessions=4, ctx_per_session=512) as w:
        caps = []
        for ep in [*r.endpoints, *w.endpoints]:
            with WorkerClient(ep) as c:
                caps.append(c.capability().capacity)
    kv = [c.kv_bytes for c in caps]
    ctx.results["kv_bytes"] = {"0:15": kv[0], "15:30": kv[1], "whole 0:30": kv[2]}
    ctx.record_command("dgr.route.LocalRoute(model, 0:15,15:30 and 0:30, max_sessions=4, ctx_per_session=512): "
                       "GetCapability().capacity.kv_bytes")
    ctx.check("KV is allocated only for owned layers (live: the two shards' KV budgets add up to the whole model's)",
              all(kv) and kv[0] < kv[2] and kv[1] < kv[2] and abs(kv[0] + kv[1] - kv[2]) <= 0.01 * kv[2],
              f"KV bytes for 4 sessions x 512 positions: 0:15 {kv[0]}, 15:30 {kv[1]}, whole {kv[2]}")
    tests_criterion(ctx, "prefill append, decode append, truncate, release, TTL/LRU eviction and an explicit "
                         "cache-miss response",
                    [T + "test_worker_fake.py::test_truncate_and_sampling_are_deterministic",
                     T + "test_worker_fake_lifecycle.py::test_ttl_eviction_gives_cache_miss",
                     T + "test_worker_fake_lifecycle.py::test_budgets_reject_with_resource_exhausted"])
    # LRU eviction has no Python test: the C++ session table and reaper tests pin it
    command_criterion(ctx, "LRU eviction takes the least recently used idle session, never a busy one or the "
                           "requester (C++ session table and reaper tests, CTest)",
                      ["ctest", "--test-dir", str(paths.backend_build_dir(ctx.backend)), "-R",
                       "session_table|session_reaper", "--output-on-failure"], needle="tests passed")
    tests_criterion(ctx, "at least four concurrent sessions on a small real model complete without token or KV "
                         "cross-talk",
                    [T + "test_worker_llama.py::test_smollm2_eight_sessions",
                     T + "test_route_real.py::test_four_concurrent_sessions_isolated_and_released"], real=True)
    tests_criterion(ctx, "cancelling or releasing one session leaves the others intact and memory returns to the "
                         "configured budget",
                    [T + "test_worker_fake.py::test_stop_one_of_eight_mid_generation",
                     T + "test_route_driver.py::test_cancel_one_session_others_continue",
                     T + "test_chain_route.py::test_cancel_one_session_mid_generation_others_complete",
                     T + "test_worker_fake_lifecycle.py::test_queue_limit_rejects_and_memory_stays_bounded"])
