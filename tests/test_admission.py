"""Admission: a Shard capability against a route request, every reason reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr.route.admission import AdmissionDecision, Reason, RouteRequest, ShardCapability, admit
from dgr.gguf.recipe import DEFAULT_KV_LAYOUT, Registry, RegistryEntry, RuntimeRecipe, load_registry

N_LAYER = 30


def recipe(**change) -> RuntimeRecipe:
    r = RuntimeRecipe(artifact_id="a" * 64, tokenizer_digest="b" * 64, arch_adapter="llama", arch_adapter_version=1,
                      dgr_version="0.1.0", pin_commit="c" * 40, patch_digest="d" * 64)
    return r.with_(**change)


def entry(status: str = "certified", backends: tuple[str, ...] = ("cpu",), **change) -> RegistryEntry:
    fields = dict(name="llama-test", status=status, arch_adapter="llama", arch_adapter_version=1,
                  activation_dtype="f32", kv_dtype="f16", kv_layout=DEFAULT_KV_LAYOUT, boundary_schema_version=1,
                  backends=backends, evidence="evidence/DGR-010")
    fields.update(change)
    return RegistryEntry(**fields)


CERTIFIED = Registry((entry(),))


def decide(cap_recipe=None, req_recipe=None, *, cap_range=(0, 15), req_range=(0, 15), registry=CERTIFIED,
           cap_fp="", req_fp="", cap_layers=N_LAYER) -> AdmissionDecision:
    cap = ShardCapability(cap_recipe or recipe(), cap_range[0], cap_range[1], cap_layers, cap_fp)
    req = RouteRequest(req_recipe or recipe(), req_range[0], req_range[1], N_LAYER, req_fp)
    return admit(cap, req, registry)


def test_matching_certified_shard_is_admitted() -> None:
    d = decide(cap_fp=recipe().fingerprint(), req_fp=recipe().fingerprint())
    assert d.admitted, d.summary()
    assert d.summary() == "admitted"


def test_sub_range_with_later_effective_start_is_admitted() -> None:
    assert decide(cap_range=(10, 30), req_range=(15, 30)).admitted


@pytest.mark.parametrize("change,reason", [
    ({"artifact_id": "e" * 64}, Reason.ARTIFACT_MISMATCH),
    ({"tokenizer_digest": "e" * 64}, Reason.TOKENIZER_MISMATCH),
    ({"boundary_schema_version": 2}, Reason.BOUNDARY_SCHEMA_MISMATCH),
    ({"activation_dtype": "f16"}, Reason.ACTIVATION_RECIPE_MISMATCH),
    ({"kv_dtype": "q8_0"}, Reason.CACHE_LAYOUT_MISMATCH),
    ({"kv_layout": "llama-unified-v2"}, Reason.CACHE_LAYOUT_MISMATCH),
    ({"pin_commit": "e" * 40}, Reason.RUNTIME_MISMATCH),
    ({"patch_digest": "e" * 64}, Reason.RUNTIME_MISMATCH),
])
def test_each_mismatch_is_rejected_with_its_reason(change: dict, reason: Reason) -> None:
    d = decide(cap_recipe=recipe(**change))
    assert not d.admitted
    assert reason in d.reasons, d.summary()
    assert Reason.FINGERPRINT_MISMATCH not in d.reasons  # the specific reason, not a generic one


def test_architecture_mismatch() -> None:
    d = decide(cap_recipe=recipe(arch_adapter_version=2))
    assert {Reason.ARCHITECTURE_MISMATCH, Reason.ARCHITECTURE_UNSUPPORTED} <= d.reasons


def test_unknown_architecture_fails_closed_even_if_registered_certified() -> None:
    q = recipe(arch_adapter="qwen2")
    reg = Registry((entry(arch_adapter="qwen2"),))
    d = decide(cap_recipe=q, req_recipe=q, registry=reg)
    assert not d.admitted and Reason.ARCHITECTURE_UNSUPPORTED in d.reasons


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_packaged_registry_keeps_qwen3_dark_with_its_reason(arch: str) -> None:
    # Qwen3 / Qwen3-MoE have adapters but no real-model certification: dark, with the reason
    q = recipe(arch_adapter=arch)
    d = decide(cap_recipe=q, req_recipe=q, registry=load_registry())
    assert d.reasons == {Reason.RECIPE_DARK}
    (why,) = [r.detail for r in d.rejections]
    assert f"recipe {arch}-v1-f32wire-f16kv is registered but dark" in why and "waits on a real" in why
    assert "dgr accept DGR-015 --model" in why


def test_packaged_registry_certifies_gemma3_on_cpu_only() -> None:
    g = recipe(arch_adapter="gemma3")
    reg = load_registry()
    e = reg.lookup(g)
    assert e is not None and e.status == "certified" and e.evidence == "evidence/DGR-015"
    assert decide(cap_recipe=g, req_recipe=g, registry=reg).admitted
    assert reg.routable(g) and not reg.routable(g.with_(backend="vulkan"))


@pytest.mark.parametrize("cap_range,req_range", [((0, 15), (0, 16)), ((15, 30), (10, 30)), ((0, 15), (15, 30)),
                                                 ((0, 15), (5, 5)), ((0, 30), (0, 31))])
def test_range_not_served(cap_range, req_range) -> None:
    d = decide(cap_range=cap_range, req_range=req_range)
    assert d.reasons == {Reason.RANGE_NOT_SERVED}, d.summary()


def test_layer_count_mismatch_is_a_range_rejection() -> None:
    assert Reason.RANGE_NOT_SERVED in decide(cap_layers=24).reasons


def test_dark_recipe_is_never_routable() -> None:
    d = decide(registry=Registry((entry(status="dark"),)))
    assert d.reasons == {Reason.RECIPE_DARK}


def test_unregistered_recipe_is_rejected() -> None:
    r = recipe(activation_dtype="bf16")
    d = decide(cap_recipe=r, req_recipe=r)
    assert d.reasons == {Reason.RECIPE_UNREGISTERED}


def test_backend_plan_must_be_certified_and_fails_closed() -> None:
    vk = "vulkan:llvmpipe"   # a Vulkan Shard is admitted only on a device class its entry holds for
    mixed_head, mixed_tail = recipe(backends="cpu+vulkan"), recipe(backend="vulkan", backends="cpu+vulkan",
                                                                   device_class=vk)
    # certified on cpu and on vulkan alone: a mixed CPU-head/Vulkan-tail route is still refused
    reg = Registry((entry(backends=("cpu", "vulkan"), devices=("cpu", vk)),))
    d = decide(cap_recipe=mixed_tail, req_recipe=mixed_head, req_range=(15, 30), cap_range=(15, 30), registry=reg)
    assert d.reasons == {Reason.BACKEND_NOT_CERTIFIED}
    vulkan = recipe(backend="vulkan", device_class=vk)
    assert decide(cap_recipe=vulkan, req_recipe=recipe(backend="vulkan"), registry=reg).admitted
    # the same Shard on a device that does not report its class: refused
    d = decide(cap_recipe=vulkan.with_(device_class=""), req_recipe=recipe(backend="vulkan"), registry=reg)
    assert d.reasons == {Reason.BACKEND_NOT_CERTIFIED} and "unknown" in d.summary()
    # a certified mixed plan admits both of its Shards
    reg = Registry((entry(backends=("cpu",)), entry(name="mixed", backends=("cpu+vulkan",), devices=("cpu", vk),
                                                     tolerance=(("max_abs_dlogprob", 0.5),))))
    for cap in (mixed_head, mixed_tail):
        assert decide(cap_recipe=cap, req_recipe=mixed_head, registry=reg).admitted
    # a Shard on another backend than the plan's, or a Vulkan Shard in a CPU route: refused
    d = decide(cap_recipe=recipe(backend="cuda", backends="cpu+vulkan"), req_recipe=mixed_head, registry=reg)
    assert Reason.BACKEND_NOT_CERTIFIED in d.reasons
    d = decide(cap_recipe=recipe(backend="vulkan"), registry=reg)
    assert d.reasons == {Reason.FINGERPRINT_MISMATCH, Reason.BACKEND_NOT_CERTIFIED}
    assert decide(cap_recipe=recipe(backends="vulkan+cpu"), req_recipe=recipe(backends="vulkan+cpu"),
                  registry=reg).reasons == {Reason.BACKEND_NOT_CERTIFIED}


def test_forged_fingerprint_is_rejected() -> None:
    d = decide(cap_fp="f" * 64)
    assert d.reasons == {Reason.FINGERPRINT_MISMATCH}


def test_every_reason_is_reported_at_once() -> None:
    bad = recipe(artifact_id="e" * 64, tokenizer_digest="e" * 64, boundary_schema_version=2,
                 activation_dtype="f16", kv_dtype="q8_0")
    d = decide(cap_recipe=bad, cap_range=(15, 30), req_range=(0, 15), registry=Registry((entry(status="dark"),)))
    assert {Reason.ARTIFACT_MISMATCH, Reason.TOKENIZER_MISMATCH, Reason.BOUNDARY_SCHEMA_MISMATCH,
            Reason.ACTIVATION_RECIPE_MISMATCH, Reason.CACHE_LAYOUT_MISMATCH, Reason.RANGE_NOT_SERVED,
            Reason.RECIPE_DARK} <= d.reasons
    assert d.summary().startswith("rejected: ")


def test_packaged_registry_keeps_uncertified_llama_dark() -> None:
    # Nothing is certified until a real distributed forward leaves evidence.
    reg = load_registry()
    d = admit(ShardCapability(recipe(), 0, 15, N_LAYER), RouteRequest(recipe(), 0, 15, N_LAYER), reg)
    e = reg.lookup(recipe())
    assert e is not None
    assert d.admitted == (e.status == "certified" and "cpu" in e.backends)
    if e.status == "dark":
        assert d.reasons == {Reason.RECIPE_DARK}


def test_non_canonical_recipe_is_rejected_not_raised() -> None:
    d = decide(cap_recipe=recipe(kv_layout="has space"))
    assert Reason.FINGERPRINT_MISMATCH in d.reasons and Reason.CACHE_LAYOUT_MISMATCH in d.reasons
