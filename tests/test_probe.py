"""A host's measured capability (`dgr worker probe`, cli/dgr/route/probe.py): the probe's figures
turned into the planner's, the capabilities file, and the command end to end on a synthetic
model (native build). Timings are not asserted, only their presence and shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dgr.errors import DgrError
from dgr.route.planner import ModelShape, load_capabilities
from dgr.route.probe import capability_from_probe, default_probe_range, merge_capability

SHAPE = ModelShape("m", (1, 1, 2, 2), (10, 10, 20, 20), 100, 100, False, 64, 8)


def raw(**over):
    r = {"layers": 2, "head": False, "tail": True, "layer_start": 2, "layer_end": 4, "n_layer": 4,
         "decode_s": {"1": 0.010, "4": 0.020}, "decode_no_output_s": {"1": 0.006, "4": 0.012},
         "prompt_s_per_token": 0.004, "prompt_no_output_s_per_token": 0.003, "skipped": [8, 16],
         "seconds": 1.0, "error": "", "threads": 2, "backend": "cpu", "fake": True, "memory_budget_bytes": 0}
    r.update(over)
    return r


def test_figures_are_per_mean_layer_with_the_logits_apart():
    e = capability_from_probe(raw(), SHAPE, name="h", memory_bytes=1 << 30)
    # layers 2:4 hold 4 of the model's 6 weight elements; the mean layer holds 1.5: 2.667 mean layers
    eq = 4 / 1.5
    assert e["layer_decode_s"]["1"] == pytest.approx(0.006 / eq)
    assert e["layer_decode_s"]["4"] == pytest.approx(0.012 / eq)
    assert e["output_decode_s"] == {"1": pytest.approx(0.004), "4": pytest.approx(0.008)}
    assert e["layer_prefill_s"] == pytest.approx(0.003 / eq)
    assert e["probe"]["skipped_rows"] == [8, 16] and e["probe"]["layers"] == [2, 4]


@pytest.mark.parametrize("over,match", [
    ({"tail": False}, "not a tail"),
    ({"error": "decode failed"}, "stopped"),
    ({"n_layer": 5}, "does not match"),
    ({"decode_no_output_s": {}}, "no decode step"),
])
def test_probes_that_cannot_make_a_capability_are_refused(over, match):
    with pytest.raises(DgrError, match=match):
        capability_from_probe(raw(**over), SHAPE, name="h", memory_bytes=1 << 30)


def test_default_range_is_a_short_tail():
    assert default_probe_range(30) == (26, 30)
    assert default_probe_range(2) == (0, 2)


def test_capabilities_file_is_created_and_hosts_replaced_by_name(tmp_path):
    f = tmp_path / "caps.json"
    a = capability_from_probe(raw(), SHAPE, name="a", memory_bytes=1 << 30)
    b = capability_from_probe(raw(), SHAPE, name="b", memory_bytes=2 << 30)
    merge_capability(f, a)
    merge_capability(f, b)
    merge_capability(f, {**a, "memory_bytes": 3 << 30})
    hosts, link = load_capabilities(f)
    assert [h.name for h in hosts] == ["a", "b"] and hosts[0].memory_bytes == 3 << 30 and link is None
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(DgrError, match="not a capabilities file"):
        merge_capability(bad, a)
    assert bad.read_text() == "[1]"




@pytest.mark.native
def test_dgr_worker_probe_then_plan(tmp_path, native_bin):
    from dgr.gguf.synth import SynthSpec, synthesize

    model = synthesize(SynthSpec(n_layer=6, dtype="q8_0"), tmp_path / "m.gguf")
    caps = tmp_path / "caps.json"
    run = lambda *a: subprocess.run([sys.executable, "-m", "dgr.main", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=300)
    for name, mem in (("fast", "4096"), ("small", "64")):
        p = run("worker", "probe", "--model", str(model), "--threads", "1", "--name", name, "--memory-mb", mem,
                "--budget-s", "3", "--out", str(caps), "--json")
        assert p.returncode == 0, p.stderr
        e = json.loads(p.stdout)
        assert e["name"] == name and e["probe"]["layers"] == [2, 6] and not e["probe"]["fake"]
        assert e["layer_decode_s"]["1"] > 0 and e["output_decode_s"]["1"] > 0 and e["layer_prefill_s"] > 0
    hosts, _ = load_capabilities(caps)
    assert [h.name for h in hosts] == ["fast", "small"]
    p = run("plan", "-c", str(caps), "--model", str(model), "--sessions", "4", "--ctx", "256", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["split"].startswith("0:") and plan["split"].endswith(":6")
    # a range that is not a tail is refused before anything loads
    p = run("worker", "probe", "--model", str(model), "--layers", "0:3")
    assert p.returncode != 0 and "does not end at the model's last layer" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.native
def test_threads_default_to_the_cpus_the_worker_may_run_on(native_bin):
    """--threads 0 (the default) is the process's affinity mask, not llama.cpp's fixed 4: a probe
    (and serve) under `taskset -c 0` computes on one thread, and says so."""
    import os
    import shutil

    exe = str(native_bin / "dgr-worker")

    def threads(*prefix: str) -> int:
        p = subprocess.run([*prefix, exe, "probe", "--fake-model", "--json", "--probe-budget-s", "0.5"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)["threads"]

    assert threads() == len(os.sched_getaffinity(0))
    if not shutil.which("taskset"):
        pytest.fail("taskset (util-linux) is missing")
    first = min(os.sched_getaffinity(0))
    assert threads("taskset", "-c", str(first)) == 1


@pytest.mark.native
def test_a_worker_started_with_a_probe_budget_reports_its_measured_cost(native_bin):
    from dgr.route.supervisor import WorkerArgs, WorkerProcess

    plain = WorkerProcess.start(WorkerArgs(fake_model=True, layers=(4, 8)), binary=native_bin / "dgr-worker")
    probed = WorkerProcess.start(WorkerArgs(fake_model=True, probe_budget_s=1.0), binary=native_bin / "dgr-worker")
    try:
        assert not plain.client().capability().HasField("measured")
        m = probed.client().capability().measured
        assert [b.rows for b in m.decode] == [1, 4, 8, 16] and all(b.step_seconds > 0 for b in m.decode)
        assert all(b.step_no_output_seconds > 0 for b in m.decode), "a tail measures the logits apart"
        assert 0 < m.duty <= 1 and m.prompt_seconds_per_token > 0 and not m.from_cache   # the fake has no artifact id
        # the worker serves normally after its probe: its sessions start at position 0, and it
        # answers as a worker that never probed
        from fakeroute import run_alone
        whole = WorkerProcess.start(WorkerArgs(fake_model=True), binary=native_bin / "dgr-worker")
        try:
            assert run_alone(probed.client(), [1, 2, 3], n=3) == run_alone(whole.client(), [1, 2, 3], n=3)
        finally:
            whole.kill()
    finally:
        plain.kill()
        probed.kill()
    r = subprocess.run([str(native_bin / "dgr-worker"), "serve", "--fake-model", "--probe-budget-s", "601"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "probe-budget-s" in r.stderr


@pytest.mark.native
def test_dgr_plan_from_running_workers(tmp_path, native_bin):
    from dgr.gguf.synth import SynthSpec, synthesize
    from dgr.route.supervisor import WorkerArgs, WorkerProcess

    model = synthesize(SynthSpec(n_layer=6, dtype="q8_0"), tmp_path / "m.gguf")
    env_cache = {"DGR_PROBE_CACHE_DIR": str(tmp_path / "cache")}
    import os
    old = {k: os.environ.get(k) for k in env_cache}
    os.environ.update(env_cache)
    ws = []
    try:
        for rng, mem in (((0, 3), 512.0), ((3, 6), 512.0)):
            ws.append(WorkerProcess.start(WorkerArgs(model=model, layers=rng, threads=1, probe_budget_s=2.0,
                                                     memory_budget_mb=mem), binary=native_bin / "dgr-worker"))
        assert sorted(p.name for p in (tmp_path / "cache").iterdir())[0].endswith("-0_3-cpu-t1.json")
        run = lambda *a: subprocess.run([sys.executable, "-m", "dgr.main", *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=120)
        p = run("plan", "--model", str(model), "--worker", f"a={ws[0].target}", "--worker", f"b={ws[1].target}",
                "--sessions", "4", "--ctx", "128", "--json")
        assert p.returncode == 0, p.stderr
        assert "a's output matrix cost is estimated from b's" in p.stderr
        plan = json.loads(p.stdout)
        assert plan["split"].startswith("0:") and plan["split"].endswith(":6") and set(plan["hosts"]) <= {"a", "b"}
        # only heads: nobody measured the output matrix
        p = run("plan", "--model", str(model), "--worker", f"a={ws[0].target}")
        assert p.returncode != 0 and "none measured the output matrix" in p.stderr and "Traceback" not in p.stderr
        p = run("plan", "--model", str(model))
        assert p.returncode != 0 and "one of the two" in p.stderr
    finally:
        for w in ws:
            w.kill()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, "0.1", True])
def test_capability_from_probe_refuses_figures_that_are_not_seconds(bad):
    """A NaN would pass the clamps (max(1e-9, nan) is 1e-9) and read as a 1 ns step."""
    shape = ModelShape.uniform(4, layer_bytes=1000, output_bytes=1000, embed_bytes=1000, n_embd=8,
                               kv_bytes_per_cell_layer=64)
    probe = {"tail": True, "layer_start": 0, "layer_end": 4, "n_layer": 4, "decode_s": {"1": 0.01, "4": bad},
             "decode_no_output_s": {"1": 0.008, "4": 0.02}, "prompt_s_per_token": 0.001}
    with pytest.raises(DgrError, match="not a finite, non-negative"):
        capability_from_probe(probe, shape, name="h", memory_bytes=1 << 30)
