"""Runtime recipe, compatibility fingerprint, shared vectors, registry."""

from __future__ import annotations

import subprocess
from dataclasses import fields, replace
from pathlib import Path

import pytest
from built import built

from dgr.gguf import recipe as R
from dgr.errors import DgrError
from dgr.gguf.slice import LayerRange, slice_gguf
from dgr.gguf.synth import SynthSpec, synthesize

REPO = Path(__file__).resolve().parent.parent
VECTORS = REPO / "tests" / "vectors" / "fingerprint"
RUNTIME = ("0.1.0", "0c1e57098bba43ac29e6e3b677cdceebdd22334f", "d" * 64)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))


def base() -> R.RuntimeRecipe:
    return R.RuntimeRecipe(artifact_id="a" * 64, tokenizer_digest="b" * 64, arch_adapter="llama",
                           arch_adapter_version=1, dgr_version="0.1.0", pin_commit="c" * 40, patch_digest="d" * 64)


def test_canonical_text_shape() -> None:
    text = base().canonical()
    lines = text.splitlines()
    assert lines[0] == "dgr-recipe-fingerprint/v2"
    assert [ln.split("=")[0] for ln in lines[1:]] == list(R.FINGERPRINT_FIELDS) == sorted(R.FINGERPRINT_FIELDS)
    assert text.endswith("\n") and "artifact_id=" + "a" * 64 in lines


@pytest.mark.parametrize("field", R.FINGERPRINT_FIELDS)
def test_every_fingerprint_field_changes_the_fingerprint(field: str) -> None:
    r = base()
    v = getattr(r, field)
    other = v + 1 if isinstance(v, int) else ("x" + v)[:128]
    assert r.with_(**{field: other}).fingerprint() != r.fingerprint()


@pytest.mark.parametrize("change", [{"compute_dtype": "f16"}, {"dgr_version": "0.2.0"},
                                    {"weight_types_digest": "e" * 64}, {"weight_types": (("Q4_1", 3),)},
                                    {"device_class": "cpu"}])
def test_fields_outside_the_fingerprint_do_not_change_it(change: dict) -> None:
    assert base().with_(**change).fingerprint() == base().fingerprint()


def test_backend_plan_distinguishes_backends() -> None:
    cpu = base()
    vk = base().with_(backend="vulkan")
    assert vk.fingerprint() != cpu.fingerprint()
    # the Shards of a mixed route share the plan's fingerprint, whatever their own backend
    head = base().with_(backends="cpu+vulkan")
    tail = base().with_(backend="vulkan", backends="cpu+vulkan")
    assert head.fingerprint() == tail.fingerprint()
    assert head.fingerprint() not in (cpu.fingerprint(), vk.fingerprint())
    assert base().with_(backends="vulkan+cpu").fingerprint() != head.fingerprint()
    assert R.backend_plan(["cpu", "cpu", "vulkan", "vulkan"]) == "cpu+vulkan"
    assert R.backend_plan(["vulkan"]) == "vulkan"
    with pytest.raises(R.RecipeError):
        R.backend_plan(["cpu", "opencl"])


def test_every_recipe_field_is_classified() -> None:
    outside = {"weight_types_digest", "weight_types", "compute_dtype", "backend", "dgr_version", "device_class"}
    names = {f.name for f in fields(R.RuntimeRecipe)}
    assert names == set(R.FINGERPRINT_FIELDS) | outside


@pytest.mark.parametrize("value", ["", "a b", "x=y", "f32\n", "é", "z" * 129])
def test_non_canonical_values_are_refused(value: str) -> None:
    with pytest.raises(R.RecipeError):
        base().with_(kv_layout=value).fingerprint()


def test_committed_vectors_match_the_generator(tmp_path: Path) -> None:
    R.write_vectors(tmp_path)
    for name in ("recipes.txt", "sha256.txt"):
        assert (VECTORS / name).read_text() == (tmp_path / name).read_text(), \
            f"tests/vectors/fingerprint/{name} drifted: run `python -m dgr.gguf.recipe write-vectors`"


def test_vectors_agree_with_python() -> None:
    cases = R.read_vector_cases(VECTORS / "recipes.txt")
    assert len(cases) >= 15
    for c in cases:
        values = {k: c[k] for k in R.FINGERPRINT_FIELDS}
        if c.get("expect") == "error":
            with pytest.raises(R.RecipeError):
                R.fingerprint_of(values)
        else:
            assert R.fingerprint_of(values) == c["fingerprint"], c["case"]


def test_recipe_for_whole_file_and_slice_agree(tmp_path: Path) -> None:
    src = synthesize(SynthSpec(n_layer=4, dtype="q8_0", seed=2), tmp_path / "m.gguf")
    tail = slice_gguf(src, LayerRange(2, 4), tmp_path / "t.gguf", progress=False).path
    a = R.recipe_for(src, runtime=RUNTIME, progress=False)
    b = R.recipe_for(tail, runtime=RUNTIME, progress=False)
    assert a.fingerprint() == b.fingerprint()
    assert R.recipe_for(tail, runtime=RUNTIME, backend="vulkan", progress=False).fingerprint() != a.fingerprint()
    mixed = R.recipe_for(tail, runtime=RUNTIME, backend="vulkan", backends="cpu+vulkan", progress=False)
    assert mixed.fingerprint() == R.recipe_for(src, runtime=RUNTIME, backends="cpu+vulkan", progress=False).fingerprint()
    with pytest.raises(R.RecipeError, match="not part of"):
        R.recipe_for(tail, runtime=RUNTIME, backend="cuda", backends="cpu+vulkan", progress=False)
    assert a.weight_types_digest == b.weight_types_digest and dict(a.weight_types) == {"F32": 9, "Q8_0": 30}
    assert a.arch_adapter == "llama" and a.boundary_schema_version == R.BOUNDARY_SCHEMA_VERSION
    assert R.recipe_for(src, runtime=RUNTIME, kv_dtype="q8_0", progress=False).fingerprint() != a.fingerprint()


def test_recipe_for_unknown_architecture_fails_closed(tmp_path: Path) -> None:
    src = synthesize(SynthSpec(arch="qwen2", n_layer=2, tied=True), tmp_path / "q.gguf")
    with pytest.raises(DgrError, match="fail closed"):
        R.recipe_for(src, runtime=RUNTIME, progress=False)


def test_packaged_registry_loads_and_nothing_dark_routes() -> None:
    reg = R.load_registry()
    assert reg.entries
    llama = reg.lookup(base())
    assert llama is not None and llama.arch_adapter == "llama"
    for e in reg.entries:
        assert e.status in ("certified", "dark")
        if e.status == "dark":
            probe = base().with_(arch_adapter=e.arch_adapter, arch_adapter_version=e.arch_adapter_version,
                                 activation_dtype=e.activation_dtype, kv_dtype=e.kv_dtype, kv_layout=e.kv_layout,
                                 boundary_schema_version=e.boundary_schema_version, backend=e.backends[0])
            assert not reg.routable(probe)


def _registry(tmp_path: Path, status: str, evidence: str = "evidence/DGR-010", backends: str = '["cpu"]',
              devices: str = '["cpu"]') -> Path:
    p = tmp_path / "r.toml"
    p.write_text(f"""[[recipe]]
name = "t"
status = "{status}"
arch_adapter = "llama"
arch_adapter_version = 1
activation_dtype = "f32"
kv_dtype = "f16"
kv_layout = "{R.DEFAULT_KV_LAYOUT}"
boundary_schema_version = 1
backends = {backends}
devices = {devices}
evidence = "{evidence}"
""")
    return p


def test_registry_routable_only_when_certified_on_that_backend(tmp_path: Path) -> None:
    reg = R.load_registry(_registry(tmp_path, "certified"))
    assert reg.routable(base())
    assert not reg.routable(base().with_(backend="vulkan"))
    assert not reg.routable(base().with_(activation_dtype="f16"))   # unregistered class
    assert not R.load_registry(_registry(tmp_path, "dark")).routable(base())


def test_registry_refuses_certified_without_evidence_and_bad_status(tmp_path: Path) -> None:
    with pytest.raises(DgrError, match="without evidence"):
        R.load_registry(_registry(tmp_path, "certified", evidence=""))
    with pytest.raises(DgrError, match="status"):
        R.load_registry(_registry(tmp_path, "maybe"))


@pytest.mark.native
def test_cpp_fingerprint_test_passes() -> None:
    exe = built("fingerprint_test", "dgr build --tests")
    r = subprocess.run([str(exe)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_cli_recipe_json(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from dgr.main import app

    src = synthesize(SynthSpec(n_layer=2, seed=4), tmp_path / "m.gguf")
    r = CliRunner().invoke(app, ["gguf", "recipe", str(src), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["arch_adapter"] == "llama" and len(out["fingerprint"]) == 64
    # Routable exactly when the packaged registry certifies this recipe class on cpu.
    assert out["routable"] is R.load_registry().routable(R.recipe_for(src, runtime=RUNTIME, progress=False))


def test_every_certified_recipe_names_passing_evidence_in_the_repo() -> None:
    import json

    root = Path(__file__).resolve().parent.parent
    for e in R.load_registry().entries:
        if e.status != "certified":
            continue
        results = root / e.evidence / "results.json"
        assert results.is_file(), f"{e.name}: {results} missing"
        assert json.loads(results.read_text())["verdict"] == "pass", e.name


def test_certified_entries_follow_from_their_evidence() -> None:
    """The packaged registry: every certified entry's evidence passed, and a mixed plan's drift
    is within the tolerance the entry states (otherwise the entry must stay dark)."""
    from dgr import paths

    reg = R.load_registry()
    problems = [p for e in reg.entries for p in R.certification_problems(e, paths.repo_root())]
    assert not problems, problems


def test_certification_problems_reads_the_drift(tmp_path: Path) -> None:
    import json

    ev = tmp_path / "evidence" / "DGR-X"
    ev.mkdir(parents=True)
    drift = [{"plan": "cpu+vulkan", "tokens": 128, "top1_agreement": 0.99, "max_abs_dlogprob": 0.2}]
    (ev / "results.json").write_text(json.dumps({"verdict": "pass", "metrics": {"drift": drift}}))
    e = R.RegistryEntry("m", "certified", "llama", 1, "f32", "f16", R.DEFAULT_KV_LAYOUT, 1, ("cpu+vulkan",),
                        "evidence/DGR-X", tolerance=(("tokens", 64), ("top1_agreement_min", 0.95),
                                                     ("max_abs_dlogprob", 0.5)))
    assert R.certification_problems(e, tmp_path) == []
    assert R.certification_problems(replace(e, tolerance=(("max_abs_dlogprob", 0.1),)), tmp_path)
    assert R.certification_problems(replace(e, backends=("cpu+vulkan", "vulkan+cpu")), tmp_path)
    drift[0]["max_abs_dlogprob"] = "inf"
    (ev / "results.json").write_text(json.dumps({"verdict": "pass", "metrics": {"drift": drift}}))
    assert R.certification_problems(e, tmp_path)
    (ev / "results.json").write_text(json.dumps({"verdict": "fail", "metrics": {}}))
    assert R.certification_problems(replace(e, tolerance=()), tmp_path)


def test_certified_entry_must_state_its_devices_and_empty_means_local_only(tmp_path: Path) -> None:
    p = _registry(tmp_path, "certified")
    p.write_text(p.read_text().replace('devices = ["cpu"]\n', ""))
    with pytest.raises(DgrError, match="certified without devices"):
        R.load_registry(p)
    reg = R.load_registry(_registry(tmp_path, "certified", devices="[]"), local=False)
    assert reg.entries[0].devices == ()
    assert not reg.routable(base())
    assert "certified on no device, not on device class cpu" in reg.refusal(base())


def test_mixed_plan_certified_without_tolerance_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DgrError, match="tolerance"):
        R.load_registry(_registry(tmp_path, "certified", backends='["cpu+vulkan"]'))
    with pytest.raises(DgrError, match="not a backend plan"):
        R.load_registry(_registry(tmp_path, "dark", backends='["cpu,vulkan"]'))
