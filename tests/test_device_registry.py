"""Certification per device class: the registry's `devices`, Registry.routable and admission on a
Shard's device class, local evidence (dgr certify) merged on this machine only, hostile evidence
files, registrations, and `dgr gguf recipe --device-class`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from dgr.errors import DgrError
from dgr.gguf import recipe as R
from dgr.route.admission import Reason, RouteRequest, ShardCapability, admit

N_LAYER = 30
VK_ENTRY = "llama-v1-f32wire-f16kv-vulkan"
MIXED_ENTRY = "llama-v1-f32wire-f16kv-mixed-cpu-vulkan"


@pytest.fixture(autouse=True)
def _empty_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test reads its own (empty) local evidence store, never this machine's."""
    store = tmp_path / "certified"
    monkeypatch.setenv("DGR_CERT_DIR", str(store))
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))
    return store


def recipe(**change) -> R.RuntimeRecipe:
    r = R.RuntimeRecipe(artifact_id="a" * 64, tokenizer_digest="b" * 64, arch_adapter="llama", arch_adapter_version=1,
                        dgr_version="0.1.0", pin_commit="c" * 40, patch_digest="sha256:" + "d" * 64)
    return r.with_(**change)


def vulkan(device_class: str = "", **change) -> R.RuntimeRecipe:
    return recipe(backend="vulkan", device_class=device_class, **change)


def evidence(r: R.RuntimeRecipe, entry: str, classes: list[str], **change) -> dict:
    """A local evidence document as `dgr certify` writes it (a passing one unless changed)."""
    mixed = "+" in r.plan
    runs = [{"split": "0:15,15:30", "backends": R.plan_backends(r.plan),
             **({"drift": {"tokens": 128, "top1_agreement": 0.99, "greedy_agreement": 0.5,
                           "max_abs_dlogprob": 0.1, "max_abs_dlogprob_topk": 0.3,
                           "first_divergence": [7, None]}} if mixed
                else {"parity": {"identical": True, "prompts": 4, "tokens": 128, "agreeing_tokens": 128,
                                 "first_divergence": [None] * 4}})}]
    doc = {"kind": R.EVIDENCE_KIND, "schema": R.EVIDENCE_SCHEMA, "verdict": "pass", "entry": entry, "plan": r.plan,
           "backends": R.plan_backends(r.plan), "device_classes": classes, "devices": [], "runs": runs,
           "artifact_id": r.artifact_id, "fingerprint": r.fingerprint(), "recipe": r.to_json(), "fake": False,
           "dgr_version": "0.1.0", "dgr_commit": "", "date": "2026-12-07T00:00:00+00:00"}
    doc.update(change)
    return doc


def write(store: Path, name: str, doc: object) -> Path:
    store.mkdir(parents=True, exist_ok=True)
    p = store / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


# ---- the packaged registry ----

def test_packaged_entries_state_the_devices_of_their_evidence() -> None:
    reg = R.load_registry()
    by = {e.name: e for e in reg.entries}
    assert by["llama-v1-f32wire-f16kv"].devices == ("cpu",)
    assert by["gemma3-v1-f32wire-f16kv"].devices == ("cpu",)
    assert by[VK_ENTRY].devices == ("vulkan:llvmpipe",)
    assert by[MIXED_ENTRY].devices == ("cpu", "vulkan:llvmpipe")
    # nothing is certified on CUDA or on a GPU: there is no such evidence
    assert not [d for e in reg.entries for d in e.devices if d.startswith(("cuda", "hip", "metal"))
                or d.startswith("vulkan:") and d != "vulkan:llvmpipe"]
    # every certified entry states devices; only the CUDA plan has none (local certification only)
    assert [e.name for e in reg.entries if e.status == "certified" and not e.devices] == ["llama-v1-f32wire-f16kv-cuda"]
    assert by["llama-v1-f32wire-f16kv-cuda"].backends == ("cuda",)


def test_an_uncertified_device_class_is_refused_naming_dgr_certify() -> None:
    reg = R.load_registry()
    assert reg.routable(vulkan("vulkan:llvmpipe"))
    gpu = vulkan("vulkan:nvidia")
    assert not reg.routable(gpu)
    why = reg.refusal(gpu)
    assert "vulkan:llvmpipe" in why and "vulkan:nvidia" in why and "`dgr certify --backend vulkan`" in why
    # the same for a Shard of the mixed plan, and for a CUDA device that no evidence certifies
    tail = vulkan("vulkan:nvidia", backends="cpu+vulkan")
    assert not reg.routable(tail) and "`dgr certify --backend cpu,vulkan`" in reg.refusal(tail)
    assert reg.routable(recipe(backends="cpu+vulkan")) and reg.routable(tail.with_(device_class="vulkan:llvmpipe"))
    cuda = recipe(backend="cuda", device_class="cuda:sm_90")
    assert not reg.routable(cuda) and "`dgr certify --backend cuda`" in reg.refusal(cuda)


@pytest.mark.parametrize("device_class, says", [
    ("", "unknown"),                       # an accelerator worker that reports no device
    ("cpu", "not a vulkan device"),        # a class of another backend
    ("cuda:sm_90", "not a vulkan device"),
    ("vulkan:NVIDIA", "not a device class"),
    ("vulkan:a b", "not a device class"),
    ("vulkan:../x", "not a device class"),
    ("vulkan:" + "x" * 80, "not a device class"),
])
def test_unknown_or_malformed_device_classes_never_route(device_class: str, says: str) -> None:
    reg = R.load_registry()
    r = vulkan(device_class)
    assert not reg.routable(r) and says in reg.refusal(r)


def test_a_cpu_shard_without_a_device_class_is_the_cpu() -> None:
    reg = R.load_registry()
    assert recipe().effective_device_class == "cpu" and reg.routable(recipe())
    assert vulkan().effective_device_class == ""


@pytest.mark.parametrize("text", ["cpu", "vulkan:llvmpipe", "vulkan:nvidia", "cuda:sm_90", "hip:gfx942",
                                  "cuda:nvidia-h100-80gb-hbm3"])
def test_device_class_syntax_accepts_what_the_worker_writes(text: str) -> None:
    assert R.device_class_backend(text) == text.split(":")[0]


@pytest.mark.parametrize("text", ["", "gpu", "cpu:x", "opencl:x", "vulkan:", "vulkan:-x", "vulkan:a:b", "vulkan:é",
                                  "vulkan:a\n", "Vulkan:x"])
def test_device_class_syntax_refuses_the_rest(text: str) -> None:
    with pytest.raises(R.RecipeError):
        R.device_class_backend(text)


def test_device_class_is_outside_the_fingerprint() -> None:
    assert vulkan("vulkan:nvidia").fingerprint() == vulkan().fingerprint() == vulkan("vulkan:llvmpipe").fingerprint()
    assert "device_class" not in R.FINGERPRINT_FIELDS


def _toml(tmp_path: Path, devices: str | None, backends: str = '["vulkan"]', status: str = "certified") -> Path:
    p = tmp_path / "r.toml"
    dev = "" if devices is None else f"devices = {devices}\n"
    p.write_text(f'[[recipe]]\nname = "t"\nstatus = "{status}"\narch_adapter = "llama"\narch_adapter_version = 1\n'
                 f'activation_dtype = "f32"\nkv_dtype = "f16"\nkv_layout = "{R.DEFAULT_KV_LAYOUT}"\n'
                 f'boundary_schema_version = 1\nbackends = {backends}\n{dev}evidence = "evidence/DGR-018"\n')
    return p


@pytest.mark.parametrize("devices, message", [
    (None, "certified without devices"),
    ('["vulkan:a b"]', "not a device class"),
    ('["cuda:sm_90"]', "a cuda device, for the backend plans vulkan"),
])
def test_registry_file_refuses_certified_entries_without_valid_devices(tmp_path: Path, devices, message) -> None:
    with pytest.raises(DgrError, match=message):
        R.load_registry(_toml(tmp_path, devices))
    assert R.load_registry(_toml(tmp_path, None, status="dark")).entries[0].devices == ()
    # an explicit empty list is a statement (no device in the repository's evidence), not an omission
    assert R.load_registry(_toml(tmp_path, "[]"), local=False).entries[0].devices == ()


# ---- admission ----

def _admit(cap: R.RuntimeRecipe, want: R.RuntimeRecipe, reg: R.Registry):
    return admit(ShardCapability(cap, 0, 15, N_LAYER), RouteRequest(want, 0, 15, N_LAYER), reg)


def test_admission_refuses_a_shard_on_an_uncertified_device_with_the_command() -> None:
    reg = R.load_registry()
    assert _admit(vulkan("vulkan:llvmpipe"), vulkan(), reg).admitted
    d = _admit(vulkan("vulkan:nvidia"), vulkan(), reg)
    assert d.reasons == {Reason.BACKEND_NOT_CERTIFIED}
    assert "run `dgr certify --backend vulkan` on this machine" in d.summary()
    d = _admit(vulkan(), vulkan(), reg)           # a worker that reports no device
    assert d.reasons == {Reason.BACKEND_NOT_CERTIFIED} and "unknown" in d.summary()
    # the route's own recipe names no device: the Shard's device class is what is checked
    assert _admit(vulkan("vulkan:llvmpipe"), vulkan("vulkan:nvidia"), reg).admitted


# ---- local evidence: certified on this machine only ----

def test_local_evidence_makes_the_device_routable_on_this_machine(_empty_store: Path) -> None:
    gpu = vulkan("vulkan:nvidia")
    assert not R.load_registry().routable(gpu)
    path = R.write_local_evidence(evidence(vulkan(backends="vulkan"), VK_ENTRY, ["vulkan:nvidia"]), _empty_store)
    assert path.parent == _empty_store and path.name.endswith(".json")
    reg = R.load_registry()
    assert reg.routable(gpu), reg.refusal(gpu)
    e = next(e for e in reg.entries if e.name == VK_ENTRY)
    assert e.devices == ("vulkan:llvmpipe",) and e.local_devices("vulkan") == ("vulkan:nvidia",)
    assert e.local[0].path == str(path)
    assert _admit(gpu, vulkan(), reg).admitted
    # only for the runtime it was measured with, and only where the store is read
    other = gpu.with_(pin_commit="e" * 40)
    assert not reg.routable(other) and "again" in reg.refusal(other)
    assert not R.load_registry(local=False).routable(gpu)
    assert not reg.routable(vulkan("vulkan:amd"))


def test_local_evidence_of_a_mixed_plan_holds_for_its_plan_only(_empty_store: Path) -> None:
    head = recipe(backends="cpu+vulkan")
    R.write_local_evidence(evidence(head, MIXED_ENTRY, ["cpu", "vulkan:nvidia"]), _empty_store)
    reg = R.load_registry()
    assert reg.routable(vulkan("vulkan:nvidia", backends="cpu+vulkan"))
    assert not reg.routable(vulkan("vulkan:nvidia", backends="vulkan+cpu"))   # measured cpu+vulkan only
    assert not reg.routable(vulkan("vulkan:nvidia"))                          # another entry, another plan


def test_evidence_is_never_written_into_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    from dgr import paths

    doc = evidence(vulkan(backends="vulkan"), VK_ENTRY, ["vulkan:nvidia"])
    with pytest.raises(DgrError, match="inside the repository"):
        R.write_local_evidence(doc, paths.repo_root() / "build" / "certified")


def test_store_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DGR_CERT_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert R.local_store_dir() == tmp_path / "xdg" / "dgr" / "certified"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert R.local_store_dir() == tmp_path / "home" / ".local" / "share" / "dgr" / "certified"


def _good() -> dict:
    return evidence(vulkan(backends="vulkan"), VK_ENTRY, ["vulkan:nvidia"])


def _mixed() -> dict:
    return evidence(recipe(backends="cpu+vulkan"), MIXED_ENTRY, ["cpu", "vulkan:nvidia"])


def _other_artifact() -> dict:
    d = _good()
    d["recipe"] = {**d["recipe"], "artifact_id": "e" * 64}        # recipe of another artifact, old fingerprint
    return d


def _drift_outside() -> dict:
    d = _mixed()
    d["runs"][0]["drift"]["top1_agreement"] = 0.5
    return d


def _drift_bool() -> dict:
    d = _mixed()
    d["runs"][0]["drift"]["top1_agreement"] = True            # a bool is not a figure
    return d


@pytest.mark.parametrize("name, content, says", [
    ("bad.json", "{not json", "not JSON"),
    ("bin.json", "\udcff", "not JSON"),
    ("list.json", "[1, 2]", "not a JSON object"),
    ("other.json", {"kind": "something-else"}, "not a dgr device certification"),
    ("fake.json", _good() | {"fake": True}, "fake-model workers"),
    ("fakestr.json", _good() | {"fake": "no"}, "fake is missing"),
    ("fail.json", _good() | {"verdict": "fail"}, "verdict"),
    ("types.json", _good() | {"device_classes": "vulkan:nvidia"}, "device_classes"),
    ("types2.json", _good() | {"device_classes": [1]}, "device_classes"),
    ("odd.json", _good() | {"device_classes": ["vulkan:nv idia"]}, "not a device class"),
    ("odd2.json", _good() | {"device_classes": ["vulkan:../../etc"]}, "not a device class"),
    ("wrongbackend.json", _good() | {"device_classes": ["cuda:sm_90"]}, "not one device per backend"),
    ("two.json", _mixed() | {"device_classes": ["vulkan:a", "vulkan:b"]}, "two vulkan devices"),
    ("noentry.json", _good() | {"entry": "no-such-entry"}, "does not have"),
    ("dark.json", _good() | {"entry": "llama-v1-f16wire-f16kv"}, "not certified for the backend plan"),
    ("plan.json", _good() | {"plan": "cuda", "device_classes": ["cuda:sm_90"]}, "not certified for the backend plan"),
    ("fp.json", _good() | {"fingerprint": "0" * 64}, "another artifact or runtime"),
    ("artifact.json", _other_artifact(), "another artifact or runtime"),
    ("artifact2.json", _good() | {"artifact_id": "e" * 64}, "artifact_id"),
    ("recipe.json", _good() | {"recipe": "x"}, "recipe is missing"),
    ("recipetype.json", _good() | {"recipe": {**_good()["recipe"], "arch_adapter_version": "1"}}, "not an integer"),
    ("class.json", evidence(vulkan(backends="vulkan", kv_dtype="q8_0"), VK_ENTRY, ["vulkan:nvidia"]), "not of class"),
    ("parity.json", _good() | {"runs": [{"parity": {"identical": False}}]}, "exact greedy parity"),
    ("runs.json", _good() | {"runs": []}, "runs is empty"),
    ("drift.json", _drift_outside(), "outside the tolerance"),
    ("driftbool.json", _drift_bool(), "outside the tolerance"),
])
def test_hostile_evidence_is_ignored_with_the_reason(_empty_store: Path, name: str, content, says: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    if content == "\udcff":
        _empty_store.mkdir(parents=True, exist_ok=True)
        (_empty_store / name).write_bytes(b"\xff\xfe{")
    else:
        write(_empty_store, name, content)
    reg = R.load_registry()                           # never raises
    assert not reg.routable(vulkan("vulkan:nvidia"))
    assert not reg.routable(vulkan("vulkan:nvidia", backends="cpu+vulkan"))
    assert len(reg.ignored) == 1 and name in reg.ignored[0] and says in reg.ignored[0], reg.ignored
    assert all(not e.local for e in reg.entries)
    # the writer refuses what the reader would ignore
    if isinstance(content, dict) and content.get("fake") is not True:
        with pytest.raises(DgrError):
            R.write_local_evidence(content, _empty_store / "w")


def test_odd_files_in_the_store_never_raise(_empty_store: Path) -> None:
    _empty_store.mkdir(parents=True)
    (_empty_store / "folder.json").mkdir()
    (_empty_store / "big.json").write_bytes(b" " * (R.EVIDENCE_MAX_BYTES + 1))
    (_empty_store / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (_empty_store / "notes.txt").write_text("not evidence, not read")
    (_empty_store / "link.json").symlink_to(_empty_store / "missing-target.json")
    write(_empty_store, "good.json", _good())
    reg = R.load_registry()
    assert reg.routable(vulkan("vulkan:nvidia"))
    reasons = "\n".join(reg.ignored)
    for name in ("folder.json", "big.json", "deep.json", "link.json"):
        assert name in reasons, reasons
    assert "notes.txt" not in reasons


def test_a_store_that_cannot_be_listed_is_stated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    monkeypatch.setenv("DGR_CERT_DIR", str(f))
    reg = R.load_registry()
    assert reg.ignored and "cannot list" in reg.ignored[0]
    assert reg.routable(recipe())


# ---- registrations (meshnet_adapter) ----

def test_registration_carries_the_device_class_and_certified_honours_it() -> None:
    from meshnet_adapter.registration import Capacity, make_registration, registration_from_json

    reg = R.load_registry()

    def register(r: R.RuntimeRecipe):
        return make_registration(node_id="n", endpoint="127.0.0.1:1", recipe=r, architecture="llama",
                                 n_layer=N_LAYER, start=0, end=15, capacity=Capacity(max_sessions=2), registry=reg)

    ok, gpu, unknown = register(vulkan("vulkan:llvmpipe")), register(vulkan("vulkan:nvidia")), register(vulkan())
    assert ok.certified and not gpu.certified and not unknown.certified
    payload = gpu.to_json()
    assert payload["recipe"]["device_class"] == "vulkan:nvidia" and gpu.device_class == "vulkan:nvidia"
    assert "device_class" not in unknown.to_json()["recipe"]    # absent: reads as a payload from before
    back = registration_from_json(json.loads(gpu.dumps()), registry=reg)
    assert back.device_class == "vulkan:nvidia" and not back.certified
    assert registration_from_json(json.loads(ok.dumps()), registry=reg).certified
    # the Tracker's registry decides, not the sender's claim; a hostile class is refused
    forged = json.loads(gpu.dumps())
    forged["certified"] = True
    assert not registration_from_json(forged, registry=reg).certified
    forged["recipe"]["device_class"] = "vulkan:x\ny"
    with pytest.raises(DgrError, match="not a device class"):
        registration_from_json(forged, registry=reg)
    forged["recipe"]["device_class"] = 7
    with pytest.raises(DgrError):
        registration_from_json(forged, registry=reg)


def test_device_class_of_a_capability() -> None:
    cap = lambda backend, **dev: SimpleNamespace(runtime=SimpleNamespace(backend=backend),  # noqa: E731
                                                 device=SimpleNamespace(**dev))
    assert R.device_class_of_capability(cap("vulkan", device_class="vulkan:nvidia")) == "vulkan:nvidia"
    assert R.device_class_of_capability(cap("cpu")) == "cpu"                  # a CPU worker from before DeviceInfo
    assert R.device_class_of_capability(cap("vulkan")) == ""                  # unknown
    assert R.device_class_of_capability(cap("cpu", name="CPU")) == ""         # a device without a class: unknown
    from dgr.shard.v1 import shard_runtime_pb2 as pb

    empty = pb.GetCapabilityResponse(runtime=pb.RuntimeInfo(backend="cpu"))
    assert R.device_class_of_capability(empty) == "cpu"
    assert R.device_class_of_capability(pb.GetCapabilityResponse(runtime=pb.RuntimeInfo(backend="vulkan"))) == ""
    full = pb.GetCapabilityResponse(runtime=pb.RuntimeInfo(backend="cuda"),
                                    device=pb.DeviceInfo(backend="cuda", device_class="cuda:sm_90"))
    assert R.device_class_of_capability(full) == "cuda:sm_90"


# ---- dgr gguf recipe --device-class ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dgr.gguf.synth import SynthSpec, synthesize

    return synthesize(SynthSpec(n_layer=2, seed=4), tmp_path_factory.mktemp("m") / "m.gguf")


def _recipe_cli(*args: str) -> dict:
    from typer.testing import CliRunner

    from dgr.main import app

    r = CliRunner().invoke(app, ["gguf", "recipe", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_cli_recipe_routable_per_device_class(tiny: Path) -> None:
    out = _recipe_cli(str(tiny), "--backend", "vulkan")
    assert out["routable"] is False and out["device_class"] == "" and "device class unknown: not routable" in out["why"]
    assert out["certified_devices"] == ["vulkan:llvmpipe"]
    out = _recipe_cli(str(tiny), "--backend", "vulkan", "--device-class", "vulkan:nvidia")
    assert out["routable"] is False and "dgr certify --backend vulkan" in out["why"]
    out = _recipe_cli(str(tiny), "--backend", "vulkan", "--device-class", "vulkan:llvmpipe")
    assert out["routable"] is True and "why" not in out
    out = _recipe_cli(str(tiny))
    assert out["routable"] is True and out["device_class"] == "cpu" and out["certified_devices"] == ["cpu"]
    out = _recipe_cli(str(tiny), "--backend", "vulkan", "--plan", "cpu+vulkan", "--device-class", "vulkan:llvmpipe")
    assert out["routable"] is True and out["certified_devices"] == ["cpu", "vulkan:llvmpipe"]


def test_cli_recipe_shows_local_certifications(tiny: Path, _empty_store: Path) -> None:
    from typer.testing import CliRunner

    from dgr.main import app

    r = R.recipe_for(tiny, backend="vulkan", progress=False)
    R.write_local_evidence(evidence(r, VK_ENTRY, ["vulkan:nvidia"]), _empty_store)
    out = _recipe_cli(str(tiny), "--backend", "vulkan", "--device-class", "vulkan:nvidia")
    assert out["routable"] is True and out["certified_here"] == ["vulkan:nvidia"]
    text = CliRunner().invoke(app, ["gguf", "recipe", str(tiny), "--backend", "vulkan", "--device-class",
                                    "vulkan:nvidia"]).stdout
    assert "routable: yes" in text and "vulkan:llvmpipe, vulkan:nvidia (this machine)" in text


@pytest.mark.parametrize("args, message", [
    (["--backend", "vulkan", "--device-class", "cpu"], "is a cpu device, not a vulkan one"),
    (["--backend", "vulkan", "--device-class", "vulkan:A B"], "not a device class"),
])
def test_cli_recipe_refuses_bad_device_classes_in_one_line(tiny: Path, args: list[str], message: str) -> None:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "from dgr.main import main; main()", "gguf", "recipe", str(tiny), *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_registry_entry_built_in_code_defaults_to_the_cpu() -> None:
    e = R.RegistryEntry("m", "certified", "llama", 1, "f32", "f16", R.DEFAULT_KV_LAYOUT, 1, ("cpu",), "evidence/X")
    reg = R.Registry((e,))
    assert reg.routable(recipe()) and not reg.routable(vulkan("vulkan:llvmpipe"))
    reg = R.Registry((replace(e, backends=("vulkan",), devices=("vulkan:llvmpipe",)),))
    assert reg.routable(vulkan("vulkan:llvmpipe")) and not reg.routable(vulkan("vulkan:nvidia"))
