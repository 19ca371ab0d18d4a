"""DGR-002: the versioned gRPC Shard protocol, shown by the generated code, the golden vectors,
the Python and C++ round-trip/compatibility tests, and live fake-model workers (no model)."""

from __future__ import annotations

import importlib.util

from ... import paths
from ..evidence import StoryContext, story
from ._common import command_criterion, dgr, tests_criterion

T = "tests/"


@story("DGR-002", "Versioned gRPC Shard protocol", lane="synthetic")
def run(ctx: StoryContext) -> None:
    proto = paths.repo_root() / "proto" / "dgr" / "shard" / "v1" / "shard_runtime.proto"
    ctx.results["proto"] = str(proto.relative_to(paths.repo_root()))
    command_criterion(ctx, "committed generated Python code matches the .proto (pinned grpcio-tools)",
                      dgr("proto", "check"))
    tests_criterion(ctx, "Protocol Buffers schema for capability, health, session stream, release and cancellation",
                    [T + "test_proto.py::test_service_and_style",
                     T + "test_proto.py::test_generated_stubs_carry_a_session_stream_and_structured_errors",
                     T + "test_worker_fake.py::test_capability_health_reflection"])
    tests_criterion(ctx, "one long-lived bidirectional stream per Route Session seam with deadlines, cancellation, "
                         "flow control and structured errors",
                    [T + "test_worker_fake_lifecycle.py::test_stream_deadline_releases_the_session",
                     T + "test_worker_fake.py::test_stop_one_of_eight_mid_generation",
                     T + "test_worker_fake.py::test_error_cases_leave_the_session_and_others_intact",
                     T + "test_worker_fake_lifecycle.py::test_queue_limit_rejects_and_memory_stays_bounded",
                     T + "test_route_driver.py::test_hung_worker_hits_the_step_deadline_and_names_the_shard"])
    tests_criterion(ctx, "bounded chunking for prefill and a small decode fast path",
                    [T + "test_proto.py::test_round_trip_large_prefill_split_over_frames",
                     T + "test_bundle.py::test_fragments_are_bounded_and_reassemble_in_any_order_across_frames",
                     T + "test_route_driver.py::test_seam_bytes_per_decode_token_fit_the_target",
                     T + "test_chain_route.py::test_chained_seam_bytes_per_decode_token_fit_the_target"])
    tests_criterion(ctx, "frames carry schema version, request/work id, session id, epoch, fingerprint, shard range and "
                         "effective start, phase, position, step, cache expectation, compression and checksum",
                    [T + "test_proto.py::test_round_trip_every_case",
                     T + "test_proto.py::test_check_request_against_capability",
                     T + "test_proto.py::test_check_request_stateless_failures"])
    tests_criterion(ctx, "versioned named-tensor bundle: per-tensor name, shape, dtype, byte order, payload fragments",
                    [T + "test_bundle.py", T + "test_proto.py::test_bundle_vectors_reassemble_to_the_generator_arrays"])
    command_criterion(ctx, "golden binary frames (tests/vectors/proto) decode as documented", dgr("proto", "vectors"))
    tests_criterion(ctx, "generated-schema round-trip and compatibility tests in Python (older/newer readers, unknown "
                         "fields and enum values kept)",
                    [T + "test_proto.py::test_vector_decodes_to_the_indexed_values_and_reencodes_identically",
                     T + "test_proto.py::test_older_schema_frame_reads_with_zero_defaults",
                     T + "test_proto.py::test_older_reader_keeps_new_fields_it_does_not_know",
                     T + "test_proto.py::test_unknown_fields_survive_decode_and_reencode",
                     T + "test_proto.py::test_unknown_frame_kind_and_enum_value_are_kept"])
    build = paths.backend_build_dir(ctx.backend)
    command_criterion(ctx, "the same vectors and bundle rules in C++ (CTest)",
                      ["ctest", "--test-dir", str(build), "-R", "proto|bundle", "--output-on-failure"],
                      needle="tests passed")
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        tests_criterion(ctx, "backend-neutral: a Python shard worker running Transformers speaks the same protocol "
                             "(route == whole model, documented error reasons)",
                        [T + "test_hf_worker.py"])
    else:
        ctx.limitation("The Transformers shard worker tests (backend neutrality) need the baseline extra, not "
                       "installed here; DGR-014 runs that worker when it is.")
    ctx.limitation("Synthetic lane: fake-model workers and golden vectors; the real-model route runs in DGR-010.")
