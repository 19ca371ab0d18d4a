"""DGR-008: the standalone C++ gRPC Shard worker, against fake-model mode (no download) — the
tests that pin each rule, plus a live look at what the worker exposes (gRPC reflection)."""

from __future__ import annotations

import re

from ..evidence import StoryContext, story
from ._common import tests_criterion

T = "tests/"


@story("DGR-008", "Standalone C++ gRPC Shard worker", lane="synthetic")
def run(ctx: StoryContext) -> None:
    from ...route.supervisor import WorkerProcess

    from ...route.local import ensure_worker

    ensure_worker(ctx.backend)
    tests_criterion(ctx, "the worker exposes capability, health, session stream, release, cancellation and metrics",
                    [T + "test_worker_fake.py::test_capability_health_reflection", T + "test_worker_fake_lifecycle.py::test_prometheus_text",
                     T + "test_worker_fake.py::test_stop_one_of_eight_mid_generation"])
    tests_criterion(ctx, "it loads one exact artifact/recipe/shard identity and refuses mismatched requests",
                    [T + "test_worker_identity.py::test_bare_worker_serves_real_identity",
                     T + "test_worker_identity.py::test_identity_flags_that_disagree_with_the_file_refuse_startup",
                     T + "test_worker_identity.py::test_slice_with_one_altered_tensor_byte_is_refused",
                     T + "test_worker_identity.py::test_truncated_gguf_refused",
                     T + "test_worker_fake.py::test_error_cases_leave_the_session_and_others_intact"])
    tests_criterion(ctx, "the stream enforces bounded messages, flow control, deadlines, idempotent steps and "
                         "independent session cancellation",
                    [T + "test_worker_fake_lifecycle.py::test_budgets_reject_with_resource_exhausted",
                     T + "test_worker_fake_lifecycle.py::test_queue_limit_rejects_and_memory_stays_bounded",
                     T + "test_worker_fake_lifecycle.py::test_stream_deadline_releases_the_session",
                     T + "test_worker_generate.py::test_cancel_stops_a_running_generation",
                     # chunk limits, step order, duplicate step replayed from the stored response
                     T + "test_worker_fake.py::test_error_cases_leave_the_session_and_others_intact",
                     T + "test_worker_ownership.py::test_owner_replay_only_with_identical_content"])
    # live: the services a client can reach (server reflection ListServices, hand-encoded request)
    from ...protocol.channel import open_channel

    with WorkerProcess.start(["--fake-model"]) as w, open_channel(w.target) as ch:
        call = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                request_serializer=lambda b: b, response_deserializer=lambda b: b)
        raw = b"".join(call(iter([b"\x3a\x00"]), timeout=10))
    ctx.record_command("dgr-worker serve --fake-model; grpc.reflection.v1alpha ListServices")
    services = sorted({m.decode() for m in re.findall(rb"[A-Za-z_][\w]*(?:\.[\w]+)+", raw)})
    allowed = {"dgr.shard.v1.ShardRuntimeService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
               "grpc.reflection.v1.ServerReflection"}
    ctx.results["services"] = services
    ctx.check("no raw llama.cpp RPC or arbitrary GGML graph execution is exposed (live: reflection lists only the "
              "Shard service, health and reflection)",
              "dgr.shard.v1.ShardRuntimeService" in services and set(services) <= allowed, ", ".join(services))
    tests_criterion(ctx, "graceful shutdown releases sessions; a crash is bounded and observable",
                    [T + "test_worker_fake_lifecycle.py::test_sigterm_drains_and_exits_zero",
                     T + "test_worker_fake_lifecycle.py::test_kill9_gives_unavailable_quickly",
                     T + "test_route_backend.py::test_supervisor_restarts_a_dead_worker_and_fails_its_sessions",
                     T + "test_route_driver.py::test_killed_worker_fails_its_sessions_bounded_and_names_the_shard"])
    tests_criterion(ctx, "Python integration tests run against the fake model mode without downloads",
                    [T + "test_worker_fake.py", T + "test_worker_fake_lifecycle.py",
                     T + "test_route_driver.py", T + "test_chain_route.py"])
