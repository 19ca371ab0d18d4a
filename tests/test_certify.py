"""`dgr certify`: this machine's device certified for a backend plan (dgr.route.certify).

The flow with a stand-in runner (no processes: figures, device reports and refusals), then end
to end with fake-model workers that claim a fake device (`dgr-worker --fake-device-class`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dgr.errors import DgrError
from dgr.gguf import recipe as R
from dgr.route import certify as C

VK_ENTRY = "llama-v1-f32wire-f16kv-vulkan"
MIXED_ENTRY = "llama-v1-f32wire-f16kv-mixed-cpu-vulkan"
PROMPTS = ["one", "two"]


@pytest.fixture(autouse=True)
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    s = tmp_path / "certified"
    monkeypatch.setenv("DGR_CERT_DIR", str(s))
    monkeypatch.setenv("DGR_CACHE_DIR", str(tmp_path / "cache"))
    return s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dgr.gguf.synth import SynthSpec, synthesize

    return synthesize(SynthSpec(n_layer=6, seed=3), tmp_path_factory.mktemp("m") / "m.gguf")


def _cap(backend: str, a: int, b: int, device_class: str, runtime: str | None = None) -> SimpleNamespace:
    named = bool(device_class)
    dev = SimpleNamespace(device_class=device_class, backend=backend if named else "", name="Dev0" if named else "",
                          description="a test device" if named else "")
    return SimpleNamespace(identity=SimpleNamespace(range=SimpleNamespace(start=a, end=b)),
                           runtime=SimpleNamespace(backend=runtime or backend), device=dev)


class StandIn:
    """A Runner without processes: the reference generates tokens 10, 11, …; a split run (more
    than one endpoint) the same, except where ``diverge`` says (prompt -> position); the forced
    run of a mixed split agrees with the reference except at ``forced_misses`` positions."""

    def __init__(self, classes: dict[str, str], *, diverge: dict[int, int] | None = None, forced_misses: int = 0,
                 runtime: str | None = None, per_worker: list[str] | None = None) -> None:
        self.classes, self.diverge, self.forced_misses = classes, diverge or {}, forced_misses
        self.runtime, self.per_worker = runtime, per_worker
        self.started: list[tuple[list[tuple[int, int]], list[str]]] = []

    @contextlib.contextmanager
    def start(self, split, backends):
        self.started.append((list(split), list(backends)))
        caps = []
        for i, ((a, b), be) in enumerate(zip(split, backends)):
            cls = self.per_worker[i] if self.per_worker and len(split) > 1 else self.classes.get(be, "")
            caps.append(_cap(be, a, b, cls, self.runtime))
        yield SimpleNamespace(endpoints=[f"127.0.0.1:{i}" for i in range(len(split))], capabilities=lambda: caps)

    def tokenize(self, endpoints, prompts):
        return [[1, 2, 3] for _ in prompts]

    def generate(self, endpoints, token_prompts, n_tokens, forced=None):
        out = []
        for p in range(len(token_prompts)):
            toks = [10 + i for i in range(n_tokens)]
            if len(endpoints) > 1 and forced is None and p in self.diverge:
                k = self.diverge[p]
                toks = toks[:k] + [99] * (n_tokens - k)
            if forced is not None:
                toks = [t if i >= self.forced_misses else 77 for i, t in enumerate(toks)]
            out.append((toks, [[(t, -0.1), (t + 1, -2.0)] for t in toks]))
        return out


def _run(model, spec, runner, **kw):
    return C.certify(model, spec, prompts=PROMPTS, n_tokens=kw.pop("n_tokens", 8), runner=runner, **kw)


# ---- the flow, with a stand-in runner ----

def test_a_passing_one_backend_certification_records_evidence_that_the_registry_honours(tiny, store) -> None:
    runner = StandIn({"vulkan": "vulkan:nvidia"})
    res = _run(tiny, "vulkan", runner)
    assert res.ok and res.path is not None and res.path.parent == store
    # the whole model, a 2- and a 3-range split, every Shard on the device being certified
    assert runner.started == [([(0, 6)], ["vulkan"]), ([(0, 3), (3, 6)], ["vulkan"] * 2),
                              ([(0, 2), (2, 4), (4, 6)], ["vulkan"] * 3)]
    doc = json.loads(res.path.read_text())
    assert doc["entry"] == VK_ENTRY and doc["plan"] == "vulkan" and doc["device_classes"] == ["vulkan:nvidia"]
    assert doc["fake"] is False and doc["verdict"] == "pass" and doc["devices"][0]["description"] == "a test device"
    assert [r["parity"]["identical"] for r in doc["runs"]] == [True, True]
    r = R.recipe_for(tiny, backend="vulkan", progress=False)
    assert doc["artifact_id"] == r.artifact_id and doc["fingerprint"] == r.fingerprint()
    assert doc["pin_commit"] == r.pin_commit and doc["date"] and "dgr_version" in doc and "dgr_commit" in doc
    reg = R.load_registry()
    assert reg.routable(r.with_(device_class="vulkan:nvidia"))
    assert not reg.routable(r.with_(device_class="vulkan:amd"))
    assert "vulkan:nvidia" in C.summary(res) and "identical" in C.summary(res)


def test_a_failed_parity_records_nothing_and_says_where(tiny, store) -> None:
    res = _run(tiny, "vulkan", StandIn({"vulkan": "vulkan:nvidia"}, diverge={1: 5}))
    assert not res.ok and res.path is None and not store.exists()
    assert res.doc["verdict"] == "fail"
    assert any("split 0:3,3:6 is not exact" in p and "prompt 1 at token 5" in p for p in res.problems), res.problems
    assert "NOT identical" in C.summary(res)
    assert not R.load_registry().routable(R.recipe_for(tiny, backend="vulkan", progress=False)
                                          .with_(device_class="vulkan:nvidia"))


def test_a_mixed_plan_is_certified_within_the_tolerance_against_the_cpu_whole_model(tiny, store) -> None:
    runner = StandIn({"cpu": "cpu", "vulkan": "vulkan:nvidia"}, forced_misses=0)
    res = _run(tiny, "cpu,vulkan", runner, n_tokens=32)      # 2 prompts x 32 = the tolerance's 64 tokens
    assert res.ok, res.problems
    assert runner.started[0] == ([(0, 6)], ["cpu"])           # the reference: the CPU whole model
    assert runner.started[2] == ([(0, 2), (2, 4), (4, 6)], ["cpu", "vulkan", "vulkan"])
    doc = res.doc
    assert doc["entry"] == MIXED_ENTRY and doc["plan"] == "cpu+vulkan"
    assert doc["device_classes"] == ["cpu", "vulkan:nvidia"] and doc["tolerance"]["top1_agreement_min"] == 0.95
    d = doc["runs"][0]["drift"]
    assert d["top1_agreement"] == 1.0 and d["tokens"] == 64 and d["first_divergence"] == [None, None]
    reg = R.load_registry()
    tail = R.recipe_for(tiny, backend="vulkan", backends="cpu+vulkan", progress=False)
    assert reg.routable(tail.with_(device_class="vulkan:nvidia"))


def test_a_mixed_plan_outside_the_tolerance_is_refused(tiny, store) -> None:
    res = _run(tiny, "cpu,vulkan", StandIn({"cpu": "cpu", "vulkan": "vulkan:nvidia"}, forced_misses=8,
                                           diverge={0: 2}), n_tokens=32)
    assert not res.ok and not store.exists()
    assert any("top1_agreement" in p and "breaks the tolerance" in p for p in res.problems), res.problems
    assert res.doc["runs"][0]["drift"]["first_divergence"] == [2, None]


def test_a_gpu_certifies_the_cuda_plan_that_no_repository_evidence_holds(tiny, store) -> None:
    """The CUDA entry lists no device: a CUDA Shard is refused, naming the command, until this
    machine's own run certifies its GPU's class; then that class routes and no other does."""
    r = R.recipe_for(tiny, backend="cuda", progress=False).with_(device_class="cuda:sm_90")
    why = R.load_registry().refusal(r)
    assert "certified on no device, not on device class cuda:sm_90" in why
    assert "dgr certify --backend cuda" in why
    res = _run(tiny, "cuda", StandIn({"cuda": "cuda:sm_90"}))
    assert res.ok and res.doc["entry"] == "llama-v1-f32wire-f16kv-cuda" and res.doc["device_classes"] == ["cuda:sm_90"]
    reg = R.load_registry()
    assert reg.routable(r)
    assert not reg.routable(r.with_(device_class="cuda:sm_89"))
    assert not reg.routable(r.with_(backend="vulkan", backends="vulkan", device_class="vulkan:nvidia"))


@pytest.mark.parametrize("runner, says", [
    (StandIn({}), "reports no device class"),                                            # a worker from before
    (StandIn({"vulkan": "cuda:sm_90"}), "a cuda device"),
    (StandIn({"vulkan": "vulkan:a b"}), "not a device class"),
    (StandIn({"vulkan": "vulkan:nvidia"}, runtime="cpu"), "built for cpu"),
    (StandIn({"vulkan": "vulkan:nvidia"}, per_worker=["vulkan:nvidia", "vulkan:amd", "vulkan:amd"]),
     "different device classes"),
])
def test_device_problems_refuse_and_record_nothing(tiny, store, runner, says) -> None:
    with pytest.raises(C.CertifyRefused, match=says):
        _run(tiny, "vulkan", runner)
    assert not store.exists()


@pytest.mark.parametrize("spec, kw, says", [
    ("cpu,cuda", {}, "no certified registry entry .* holds the backend plan cpu\\+cuda"),
    ("cuda,vulkan", {}, "holds the backend plan cuda\\+vulkan"),
    ("cpu,vulkan", {"n_tokens": 8}, "needs 64 compared tokens"),
    ("opencl", {}, "unknown backend opencl"),
    ("vulkan", {"splits": [[(0, 2), (2, 5)]]}, "not a split of the model's 6 layers"),
    ("cpu,vulkan,cpu", {"n_tokens": 32}, "holds the backend plan cpu\\+vulkan\\+cpu"),
])
def test_nothing_to_certify_is_refused_before_any_worker_starts(tiny, store, spec, kw, says) -> None:
    runner = StandIn({"vulkan": "vulkan:nvidia", "cpu": "cpu", "cuda": "cuda:sm_90"})
    with pytest.raises(DgrError, match=says):
        _run(tiny, spec, runner, **kw)
    assert runner.started == [] and not store.exists()


def test_split_backends_keep_the_plan() -> None:
    assert C.split_backends(["cpu", "vulkan"], 3) == ["cpu", "vulkan", "vulkan"]
    assert C.split_backends(["vulkan"], 3) == ["vulkan"] * 3
    assert R.backend_plan(C.split_backends(["vulkan", "cpu"], 4)) == "vulkan+cpu"
    assert C.default_splits(30) == [[(0, 15), (15, 30)], [(0, 10), (10, 20), (20, 30)]]
    assert C.default_splits(2) == [[(0, 1), (1, 2)]]
    with pytest.raises(DgrError, match="3 backends for a 2-range split"):
        C.split_backends(["cpu", "vulkan", "cpu"], 2)


# ---- end to end: fake-model workers on a fake device ----

def _dgr(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from dgr.main import main; main()", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def fake_device_worker(native_bin: Path) -> Path:
    """The worker binary, with --fake-device-class (fake-model workers that claim a device)."""
    exe = native_bin / "dgr-worker"
    p = subprocess.run([str(exe), "options", "--json"], capture_output=True, text=True, timeout=60)
    if "fake-device-class" not in p.stdout:
        why = "this dgr-worker has no --fake-device-class (rebuild it: dgr build)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return exe


@pytest.mark.native
def test_dgr_certify_fake_records_evidence_end_to_end(fake_device_worker: Path, store: Path) -> None:
    env = {"DGR_WORKER_BIN": str(fake_device_worker)}
    p = _dgr("-q", "certify", "--fake", "--backend", "vulkan", "--fake-device-class", "vulkan:fakegpu", "--tokens", "8",
             env=env)
    assert p.returncode == 0, p.stderr
    assert "split 0:3,3:6 (vulkan,vulkan): identical" in p.stdout and "holds for vulkan:fakegpu" in p.stdout
    (path,) = store.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["entry"] == VK_ENTRY and doc["device_classes"] == ["vulkan:fakegpu"] and doc["fake"] is True
    assert doc["devices"][0]["description"].startswith("fake device") and doc["devices"][0]["reported"] is True
    assert len(doc["runs"]) == 2 and all(r["device_classes"] == ["vulkan:fakegpu"] * len(r["backends"])
                                         for r in doc["runs"])
    # fake evidence certifies nothing: the registry says so, and `--list` shows why
    reg = R.load_registry()
    assert reg.ignored and "fake-model workers" in reg.ignored[0]
    listed = _dgr("certify", "--list", "--json", env=env)
    assert listed.returncode == 0 and "fake-model workers" in json.loads(listed.stdout)["ignored"][0]
    # a mixed plan: the CPU head and the fake device's tail against the CPU whole model
    p = _dgr("-q", "certify", "--fake", "--backend", "cpu,vulkan", "--fake-device-class", "vulkan:fakegpu", "--json",
             env=env)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["plan"] == "cpu+vulkan" and doc["device_classes"] == ["cpu", "vulkan:fakegpu"]
    assert doc["runs"][1]["backends"] == ["cpu", "vulkan", "vulkan"]
    assert doc["runs"][0]["drift"]["top1_agreement"] == 1.0 and Path(doc["evidence_path"]).is_file()


@pytest.mark.native
def test_dgr_certify_fake_on_the_cpu_runs_with_any_worker(native_bin: Path, store: Path) -> None:
    # a CPU Shard claims no device: it is the CPU even for a worker that reports none
    p = _dgr("-q", "certify", "--fake", "--tokens", "4", env={"DGR_WORKER_BIN": str(native_bin / "dgr-worker")})
    assert p.returncode == 0, p.stderr
    (path,) = store.glob("*.json")
    assert json.loads(path.read_text())["device_classes"] == ["cpu"]


@pytest.mark.native
def test_a_refused_certification_records_nothing_and_exits_1_in_one_line(fake_device_worker: Path, store: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """Real fake-model workers, with the split's tokens altered on their way back (as a device
    that computes differently would): exit 1, one line on stderr, no evidence."""
    from dgr import main as main_mod

    real = C.LocalRunner.generate

    def skewed(self, endpoints, token_prompts, n_tokens, forced=None):
        out = real(self, endpoints, token_prompts, n_tokens, forced)
        if len(endpoints) > 1:
            toks, top = out[0]
            out[0] = (toks[:3] + [(t + 1) % 256 for t in toks[3:]], top)
        return out

    monkeypatch.setattr(C.LocalRunner, "generate", skewed)
    monkeypatch.setenv("DGR_WORKER_BIN", str(fake_device_worker))
    monkeypatch.setattr(sys, "argv", ["dgr", "-q", "certify", "--fake", "--backend", "vulkan", "--fake-device-class",
                                      "vulkan:fakegpu", "--tokens", "6"])
    with pytest.raises(SystemExit) as exit_:
        main_mod.main()
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "not certified: split 0:3,3:6 is not exact" in err and "prompt 0 at token 3" in err
    assert "nothing recorded" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not store.exists() or not list(store.iterdir())


@pytest.mark.parametrize("args, message", [
    (["--fake", "--backend", "cpu,cuda", "--tokens", "32"], "holds the backend plan cpu+cuda"),
    (["--fake", "--backend", "opencl"], "unknown backend opencl"),
    (["--backend", "vulkan", "--fake-device-class", "vulkan:x"], "--fake-device-class goes with --fake"),
    (["--fake", "--backend", "vulkan", "--fake-device-class", "cuda:sm_90"], "has no cuda Shard"),
    (["--fake", "--fake-device-class", "vulkan:A B"], "not a device class"),
    (["--fake", "--split", "0:2,2:5"], "not a split of the model's 6 layers"),
    (["--fake", "--split", "0:2;2:6"], "bad split"),
    (["--fake", "--backend", "cpu,vulkan", "--tokens", "4"], "needs 64 compared tokens"),
])
def test_cli_refuses_bad_options_in_one_line(args: list[str], message: str, store: Path) -> None:
    p = _dgr("certify", *args, timeout=120)
    assert p.returncode == 1, p.stdout
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert not store.exists()


def test_cli_list_states_ignored_evidence(store: Path) -> None:
    store.mkdir(parents=True)
    (store / "broken.json").write_text("{")
    p = _dgr("certify", "--list", timeout=120)
    assert p.returncode == 0 and "ignored:" in p.stdout and "broken.json" in p.stdout and "not JSON" in p.stdout
    assert "Traceback" not in p.stderr
