"""The Vulkan lane: real ggml-vulkan forwards (Mesa's llvmpipe on a machine without a GPU).

Synthetic (always, when build/vulkan exists): a 2-Shard Vulkan route equals the Vulkan whole
model token for token; the workers serve the Vulkan plan's fingerprint. Real (SmolLM2, with
MESHNET_ENABLE_REAL_INFERENCE_TESTS=1): a short mixed CPU-head/Vulkan-tail route against the CPU
whole model, within the tolerance the registry states for mixed plans.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.native, pytest.mark.vulkan]


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory) -> Path:
    from dgr.gguf.synth import SynthSpec, synthesize

    return synthesize(SynthSpec(n_layer=4, dtype="f32", seed=18), tmp_path_factory.mktemp("vk") / "synth.gguf")


def test_vulkan_route_equals_vulkan_whole_model(vulkan_bin: Path, native_bin: Path, synth_model: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "dgr.main", "route", "run", "--model", str(synth_model),
                        "--split", "0:2,2:4", "--backend", "vulkan", "--parity", "--raw", "--prompt",
                        "the quick brown fox", "--max-tokens", "12", "--threads", "2", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["backends"] == ["vulkan", "vulkan"] and rep["whole_backend"] == "vulkan"
    par = rep["parity"]
    assert par["ok"] and par["compared_tokens"] >= 12 and par["agreeing_tokens"] == par["compared_tokens"]
    assert par["max_logprob_diff"] == 0.0


def test_vulkan_workers_serve_the_vulkan_plan_fingerprint(vulkan_bin: Path, native_bin: Path,
                                                          synth_model: Path) -> None:
    from dgr.gguf.recipe import recipe_for
    from dgr.protocol.client import WorkerClient
    from dgr.route.local import LocalRoute

    want = recipe_for(synth_model, backend="vulkan", progress=False)
    cpu = recipe_for(synth_model, progress=False)
    with LocalRoute(synth_model, [(0, 2), (2, 4)], backend=["cpu", "vulkan"], threads=2) as mixed:
        fps = []
        for ep in mixed.endpoints:
            with WorkerClient(ep) as c:
                cap = c.capability()
                fps.append((cap.identity.compatibility_fingerprint, cap.runtime.backend))
    plan = recipe_for(synth_model, backend="vulkan", backends="cpu+vulkan", progress=False).fingerprint()
    assert fps == [(plan, "cpu"), (plan, "vulkan")]
    assert len({plan, want.fingerprint(), cpu.fingerprint()}) == 3


@pytest.mark.real
def test_mixed_route_on_smollm2_is_within_the_registry_tolerance(vulkan_bin: Path, native_bin: Path,
                                                                  smollm2_path: Path) -> None:
    from dgr.gguf.recipe import load_registry, recipe_for
    from dgr.route import drift as route_drift

    rep = route_drift.measure(smollm2_path, [(0, 15), (15, 30)], ["cpu", "vulkan"],
                              ["What is the capital of France?"], n_tokens=16, threads=2)
    entry = load_registry().lookup(recipe_for(smollm2_path, backend="cpu", backends="cpu+vulkan", progress=False))
    assert entry is not None and "cpu+vulkan" in entry.backends and entry.tolerance
    tol = {k: v for k, v in entry.tolerance if k != "tokens"}   # a short run: 16 tokens, not the certified 64
    assert rep.tokens == 16 and len(rep.prompts[0].forced_top1) == 16
    assert rep.violations(tol) == [], route_drift.summary(rep)


def test_vulkan_worker_without_a_vulkan_device_refuses_to_start(vulkan_bin: Path, synth_model: Path) -> None:
    # without GGML_VK_VISIBLE_DEVICES ggml-vulkan skips CPU drivers (llvmpipe): no device, and the
    # worker would compute on the CPU under a vulkan recipe
    import os

    env = {k: v for k, v in os.environ.items() if k != "GGML_VK_VISIBLE_DEVICES"}
    env = {k: v for k, v in env.items() if k not in ("VK_ADD_DRIVER_FILES", "VK_ADD_ICD_FILENAMES")}
    env["VK_ICD_FILENAMES"] = env["VK_DRIVER_FILES"] = "/nonexistent-icd.json"   # no Vulkan driver, GPU or not
    r = subprocess.run([str(vulkan_bin / "dgr-worker"), "serve", "--model", str(synth_model), "--listen",
                        "127.0.0.1:0"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr[-2000:]
    err = [line for line in r.stderr.splitlines() if line.startswith("dgr-worker: error:")]
    assert len(err) == 1 and "built for backend vulkan but sees no vulkan device" in err[0]
    assert "GGML_VK_VISIBLE_DEVICES=0" in err[0]
