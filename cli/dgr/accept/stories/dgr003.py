"""DGR-003: exact artifact and runtime-recipe identity — the tests that pin each rule, and the
embedded SmolLM2 artifact's identity, recipe and a range slice bound to it."""

from __future__ import annotations

import json

from ..evidence import StoryContext, story
from ._common import dgr, tests_criterion

T = "tests/"


@story("DGR-003", "Exact artifact and runtime recipe identity", lane="local-real", needs_model=True)
def run(ctx: StoryContext) -> None:
    assert ctx.model is not None
    p = ctx.command(dgr("gguf", "recipe", str(ctx.model), "--json"), timeout=600)
    try:
        recipe = json.loads(p.stdout)
    except json.JSONDecodeError:
        recipe = {}
    ctx.results["recipe"] = recipe
    keys = ("weight_types_digest", "activation_dtype", "compute_dtype", "kv_dtype", "kv_layout", "tokenizer_digest",
            "arch_adapter", "arch_adapter_version", "backend", "dgr_version", "pin_commit", "patch_digest",
            "boundary_schema_version", "artifact_id", "fingerprint")
    missing = [k for k in keys if recipe.get(k) in (None, "")]   # a field without a value is not named
    ctx.check("the embedded model's recipe (live `dgr gguf recipe --json`) names each part separately",
              p.returncode == 0 and not missing,
              ("missing " + ", ".join(missing) + "; ") * bool(missing)
              + ", ".join(f"{k}={str(recipe.get(k))[:16]}" for k in keys if k in recipe)
              + f"; registry: {recipe.get('registry')}")
    tests_criterion(ctx, "weight quantization, activation dtype, compute dtype, KV dtype/layout, tokenizer revision, "
                         "architecture adapter, backend and runtime version are separate recipe fields",
                    [T + "test_recipe.py::test_canonical_text_shape", T + "test_recipe.py::test_every_recipe_field_is_classified",
                     T + "test_recipe.py::test_every_fingerprint_field_changes_the_fingerprint",
                     T + "test_recipe.py::test_fields_outside_the_fingerprint_do_not_change_it",
                     T + "test_recipe.py::test_cli_recipe_json"])
    sl = ctx.tmp / "head.gguf"
    ctx.command(dgr("gguf", "slice", str(ctx.model), "--layers", "0:15", "--out", str(sl)), timeout=600)
    v = ctx.command(dgr("gguf", "verify-slice", str(sl), "--source", str(ctx.model)), timeout=600)
    tests_criterion(ctx, "derivative/split artifacts bind to the exact source artifact hash and shard range",
                    [T + "test_recipe.py::test_recipe_for_whole_file_and_slice_agree",
                     T + "test_worker_identity.py::test_bare_worker_slice_serves_source_identity",
                     T + "test_slice.py"], real=True)
    ctx.check("the embedded model's 0:15 slice verifies against its source (live)", v.returncode == 0,
              (v.stdout.strip().splitlines() or [v.stderr.strip()])[-1][:300])
    tests_criterion(ctx, "one stable compatibility fingerprint (Python and C++ agree) used by capability admission and "
                         "the gRPC handshake",
                    [T + "test_identity.py::test_artifact_id_is_stable_and_cached",
                     T + "test_identity.py::test_smollm2_artifact_id_stable_and_sensitive",
                     T + "test_recipe.py::test_vectors_agree_with_python", T + "test_recipe.py::test_cpp_fingerprint_test_passes",
                     T + "test_admission.py::test_matching_certified_shard_is_admitted",
                     T + "test_route_driver.py::test_connect_rejects_incomplete_or_incompatible_routes",
                     T + "test_worker_identity.py::test_smollm2_bare_worker_identity"], real=True)
    tests_criterion(ctx, "fails closed on a mismatched artifact, tokenizer, architecture, range, boundary schema, "
                         "activation recipe or cache layout",
                    [T + "test_admission.py::test_each_mismatch_is_rejected_with_its_reason",
                     T + "test_admission.py::test_architecture_mismatch", T + "test_admission.py::test_range_not_served",
                     T + "test_admission.py::test_forged_fingerprint_is_rejected",
                     T + "test_admission.py::test_every_reason_is_reported_at_once",
                     T + "test_range_failclosed.py",
                     T + "test_worker_identity.py::test_architecture_without_adapter_refused",
                     T + "test_proto.py::test_check_request_against_capability"])
    tests_criterion(ctx, "unsupported recipes stay registered-but-dark until a real distributed forward certifies them",
                    [T + "test_admission.py::test_dark_recipe_is_never_routable",
                     T + "test_admission.py::test_packaged_registry_keeps_uncertified_llama_dark",
                     T + "test_recipe.py::test_packaged_registry_loads_and_nothing_dark_routes",
                     T + "test_recipe.py::test_registry_routable_only_when_certified_on_that_backend",
                     T + "test_recipe.py::test_registry_refuses_certified_without_evidence_and_bad_status"])
