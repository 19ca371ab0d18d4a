"""llama.cpp RPC lane (dgr.bench.rpc): tensor split from a route split, the commands, placement
checks, the skipped-with-reason paths and process cleanup (fake binaries, no build, no model);
plus one real run over two rpc-servers (real lane, and only when build/cpu-rpc is built)."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from pathlib import Path

import pytest

from dgr.upstream import build as build_mod
from dgr.bench import rpc as rpc_lane
from dgr.errors import DgrError

REPO = Path(__file__).resolve().parent.parent


# --- tensor split -------------------------------------------------------------------------------

def test_tensor_split_matches_route_split():
    assert rpc_lane.tensor_split_for(((0, 15), (15, 30))) == (15, 16)   # last shard + output layer
    assert rpc_lane.tensor_split_for(((0, 10), (10, 20), (20, 30))) == (10, 10, 11)
    assert rpc_lane.format_tensor_split((15, 16)) == "15/16"
    assert rpc_lane.format_tensor_split((14.5, 16.5)) == "14.5/16.5"


@pytest.mark.parametrize("bad", [(), ((1, 15), (15, 30)), ((0, 15), (16, 30)), ((0, 15), (15, 15))])
def test_bad_splits_are_refused(bad):
    with pytest.raises(ValueError):
        rpc_lane.tensor_split_for(bad)


def test_llama_placement_of_the_tensor_split_is_exactly_the_route_split():
    """Replays llama.cpp's float32 layer assignment: every 2- and 3-shard split lands exactly."""
    a = rpc_lane.assign_layers((15, 16), 30)
    assert a == [0] * 15 + [1] * 16   # layers 0..14 | 15..29 and the output layer on RPC1
    for n in range(2, 41):
        for b in range(1, n):
            sp = ((0, b), (b, n))
            a = rpc_lane.assign_layers(rpc_lane.tensor_split_for(sp), n, rpc_lane.ngl_for(n))
            assert rpc_lane.layer_ranges(a, 2) == [[sp[0]], [sp[1]]] and a[-1] == 1, sp
            for c in range(b + 1, n, 3):
                sp3 = ((0, b), (b, c), (c, n))
                a = rpc_lane.assign_layers(rpc_lane.tensor_split_for(sp3), n)
                assert rpc_lane.layer_ranges(a, 3) == [[x] for x in sp3] and a[-1] == 2, sp3
    # the naive proportional split (15/15) would put layer 15 on the first server
    assert rpc_lane.layer_ranges(rpc_lane.assign_layers((15, 15), 30), 2) == [[(0, 16)], [(16, 30)]]
    # -ngl below n_layer + 1 leaves the first layers on the local CPU
    assert rpc_lane.assign_layers((1, 1), 4, n_gpu_layers=3)[:2] == [None, None]


# --- commands -----------------------------------------------------------------------------------

def test_bench_command():
    cmd = rpc_lane.bench_command("/b/llama-bench", "/m/model.gguf", ["127.0.0.1:5001", "127.0.0.1:5002"],
                                 (15, 16), threads=2, n_prompt=128, n_gen=64, repeats=1, n_layer=30)
    assert cmd == ["/b/llama-bench", "-m", "/m/model.gguf", "--rpc", "127.0.0.1:5001,127.0.0.1:5002",
                   "-dev", "RPC0/RPC1", "-ngl", "99", "-sm", "layer", "-ts", "15/16",
                   "-p", "128", "-n", "64", "-t", "2", "-r", "1", "-o", "json", "-v"]
    assert cmd.index("--rpc") < cmd.index("-dev")   # devices are resolved while parsing
    big = rpc_lane.bench_command("x", "m", ["a:1", "b:2", "c:3"], (40, 40, 41), threads=1, n_prompt=1,
                                 n_gen=1, repeats=3, n_layer=120, verbose=False)
    assert big[big.index("-ngl") + 1] == "121" and big[big.index("-dev") + 1] == "RPC0/RPC1/RPC2"
    assert "-v" not in big


def test_server_command_is_loopback_and_cpu_only():
    assert rpc_lane.server_command("/b/ggml-rpc-server", 5001, 2) == [
        "/b/ggml-rpc-server", "-H", "127.0.0.1", "-p", "5001", "-t", "2", "-d", "CPU"]


# --- parsing and placement checks ---------------------------------------------------------------

LOAD_LOG = "".join(
    [f"load_tensors: layer {il:3d} assigned to device {'RPC0' if il < 15 else 'RPC1'}, is_swa = 0\n"
     for il in range(31)]
    + ["load_tensors:   CPU_Mapped model buffer size =    28.12 MiB\n",
       "load_tensors: RPC0[127.0.0.1:5001] model buffer size =    36.66 MiB\n",
       "load_tensors: RPC0[127.0.0.1:5002] model buffer size =    64.78 MiB\n"])


def test_placement_from_the_load_log():
    load = rpc_lane.parse_load_log(LOAD_LOG)
    assert load["layers_by_device"]["RPC1"][-1] == 30
    assert load["model_buffer_mib"]["RPC0[127.0.0.1:5002]"] == pytest.approx(64.78)
    per, warn = rpc_lane.check_placement(load, ((0, 15), (15, 30)), ["127.0.0.1:5001", "127.0.0.1:5002"])
    assert warn == []
    assert per[0]["layers"] == ["0:15"] and not per[0]["output_layer"] and per[0]["model_buffer_mib"] == 36.66
    assert per[1]["layers"] == ["15:30"] and per[1]["output_layer"]


def test_placement_warnings():
    eps = ["127.0.0.1:5001", "127.0.0.1:5002"]
    all_first = rpc_lane.parse_load_log("".join(
        f"load_tensors: layer {il:3d} assigned to device RPC0, is_swa = 0\n" for il in range(31)))
    _, warn = rpc_lane.check_placement(all_first, ((0, 15), (15, 30)), eps)
    assert any("127.0.0.1:5002 (RPC1) got no layers" in w for w in warn)
    assert any("got layers 0:30, the route shard is 0:15" in w for w in warn)
    local = rpc_lane.parse_load_log("load_tensors: layer   0 assigned to device CPU, is_swa = 0\n")
    assert any("local device(s) CPU" in w for w in rpc_lane.check_placement(local, ((0, 1), (1, 2)), eps)[1])
    _, warn = rpc_lane.check_placement(rpc_lane.parse_load_log(""), ((0, 15), (15, 30)), eps)
    assert warn == ["llama-bench -v printed no load log: which server got which layers is unverified"]


BENCH_JSON = [
    {"n_prompt": 128, "n_gen": 0, "avg_ts": 400.5, "stddev_ts": 3.0, "devices": "RPC0/RPC1",
     "backends": "RPC", "tensor_split": "15.00/16.00", "n_gpu_layers": 99, "split_mode": "layer", "n_threads": 2},
    {"n_prompt": 0, "n_gen": 64, "avg_ts": 50.25, "stddev_ts": 0.5, "devices": "RPC0/RPC1",
     "backends": "RPC", "tensor_split": "15.00/16.00", "n_gpu_layers": 99, "split_mode": "layer", "n_threads": 2},
]


def test_parse_bench_json():
    r = rpc_lane.parse_bench_json(json.dumps(BENCH_JSON))
    assert (r["pp_tok_s"], r["tg_tok_s"], r["pp_stddev"], r["tg_stddev"]) == (400.5, 50.25, 3.0, 0.5)
    assert r["devices"] == "RPC0/RPC1" and r["bench_tensor_split"] == "15.00/16.00"


# --- measure_rpc without a build ----------------------------------------------------------------

@pytest.fixture()
def dummy_model(tmp_path):
    m = tmp_path / "model.gguf"
    m.write_bytes(b"not a gguf")
    return m


def test_missing_model_is_an_error(tmp_path):
    with pytest.raises(DgrError, match="not found"):
        rpc_lane.measure_rpc(tmp_path / "nope.gguf", threads=1, n_prompt=8, n_gen=4)


def test_skipped_with_reason_when_not_built(dummy_model, tmp_path, monkeypatch):
    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path / "empty-build"))
    r = rpc_lane.measure_rpc(dummy_model, threads=1, n_prompt=8, n_gen=4, build_missing=False)
    assert r["skipped"] is True
    assert "llama.cpp RPC tools unavailable" in r["reason"] and "ggml-rpc-server not built" in r["reason"]
    assert str(tmp_path / "empty-build" / "cpu-rpc" / "bin") in r["reason"]


def test_skipped_with_reason_when_the_build_fails(dummy_model, monkeypatch):
    def boom(name, backend="cpu", *, build_missing=True):
        raise DgrError("ninja failed (exit 1); last lines:\nFAILED: x.o")

    monkeypatch.setattr(build_mod, "rpc_tool_binary", boom)
    r = rpc_lane.measure_rpc(dummy_model, threads=1, n_prompt=8, n_gen=4)
    assert r == {"skipped": True, "reason": "llama.cpp RPC tools unavailable: ninja failed (exit 1); "
                                            "last lines: FAILED: x.o"}


def test_invalid_split_is_skipped(dummy_model):
    r = rpc_lane.measure_rpc(dummy_model, threads=1, n_prompt=8, n_gen=4, split=((0, 10), (12, 30)))
    assert r["skipped"] and r["reason"].startswith("invalid split")


def test_rpc_tool_binary_names(tmp_path, monkeypatch):
    monkeypatch.setenv("DGR_BUILD_DIR", str(tmp_path))
    with pytest.raises(DgrError, match="unknown RPC tool"):
        build_mod.rpc_tool_binary("llama-cli", build_missing=False)
    with pytest.raises(DgrError, match="ggml-rpc-server not built"):
        build_mod.rpc_tool_binary("rpc-server", build_missing=False)
    (tmp_path / "cpu-rpc" / "bin").mkdir(parents=True)
    (tmp_path / "cpu-rpc" / "bin" / "llama-bench").write_text("")
    assert build_mod.rpc_tool_binary("llama-bench", build_missing=False) == tmp_path / "cpu-rpc" / "bin" / "llama-bench"
    assert build_mod.rpc_build_dir("vulkan") == tmp_path / "vulkan-rpc"


# --- measure_rpc with fake binaries: the process handling ----------------------------------------

FAKE_SERVER = """\
import json, os, socket, sys
a = sys.argv[1:]
port = int(a[a.index("-p") + 1])
with open(os.environ["FAKE_RPC_DIR"] + f"/server-{port}.json", "w") as f:
    json.dump({"pid": os.getpid(), "argv": a}, f)
print("Starting RPC server v7.0.0\\n  endpoint       : x\\nDevices:\\n  CPU: Fake CPU (1 MiB, 1 MiB free)\\n"
      "  transport      : TCP", flush=True)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((a[a.index("-H") + 1], port)); s.listen(8)
while True:
    c, _ = s.accept(); c.close()
"""

FAKE_BENCH = """\
import json, os, socket, sys
a = sys.argv[1:]
eps = a[a.index("--rpc") + 1].split(",")
for ep in eps:                      # the servers must be up
    h, p = ep.rsplit(":", 1); socket.create_connection((h, int(p)), timeout=2).close()
mode = os.environ.get("FAKE_BENCH_MODE", "ok")
if mode == "fail":
    sys.stderr.write("error: failed to load model\\n"); sys.exit(1)
for il in range(31):
    dev = "RPC0" if (il < 15 or mode == "lopsided") else "RPC1"
    sys.stderr.write(f"load_tensors: layer {il:3d} assigned to device {dev}, is_swa = 0\\n")
print(json.dumps(ROWS))
"""


@pytest.fixture()
def fake_tools(tmp_path, monkeypatch):
    def script(name, body):
        p = tmp_path / name
        p.write_text(f"#!{sys.executable}\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
        return p

    server = script("ggml-rpc-server", FAKE_SERVER)
    bench = script("llama-bench", FAKE_BENCH.replace("ROWS", repr(BENCH_JSON)))
    monkeypatch.setenv("FAKE_RPC_DIR", str(tmp_path))
    monkeypatch.setattr(build_mod, "rpc_tool_binary",
                        lambda name, backend="cpu", *, build_missing=True: server if "rpc" in name else bench)
    return tmp_path


def _server_pids(d: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in sorted(d.glob("server-*.json"))]


def _assert_gone(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):   # reaped, not a zombie
            os.kill(pid, 0)


def test_fake_lane_measures_and_cleans_up(fake_tools, dummy_model, caplog):
    with caplog.at_level(logging.INFO, logger="dgr.bench.rpc"):
        r = rpc_lane.measure_rpc(dummy_model, threads=3, n_prompt=128, n_gen=64)
    assert r["skipped"] is False, r
    assert (r["pp_tok_s"], r["tg_tok_s"]) == (400.5, 50.25)
    assert r["tensor_split"] == "15/16" and r["devices"] == "RPC0/RPC1" and len(r["servers"]) == 2
    assert [s["layers"] for s in r["per_server"]] == [["0:15"], ["15:30"]]
    assert not [w for w in r["warnings"] if "got" in w or "local" in w], r["warnings"]
    assert "--rpc " + ",".join(r["servers"]) in r["command"] and "-ts 15/16" in r["command"]
    argv = [json.loads(p.read_text())["argv"] for p in fake_tools.glob("server-*.json")]
    assert all(a[a.index("-t") + 1] == "3" and a[a.index("-d") + 1] == "CPU" for a in argv)
    assert any("starting 2 rpc-servers" in m for m in caplog.messages)   # progress lines go through logging
    assert list(r["server_devices"].values()) == [["CPU: Fake CPU (1 MiB, 1 MiB free)"]] * 2
    pids = _server_pids(fake_tools)
    assert len(pids) == 2
    _assert_gone(pids)


def test_fake_lane_warns_when_a_server_gets_nothing(fake_tools, dummy_model, monkeypatch):
    monkeypatch.setenv("FAKE_BENCH_MODE", "lopsided")
    r = rpc_lane.measure_rpc(dummy_model, threads=1, n_prompt=128, n_gen=64)
    assert r["skipped"] is False
    assert any("(RPC1) got no layers" in w for w in r["warnings"]), r["warnings"]
    _assert_gone(_server_pids(fake_tools))


def test_fake_lane_bench_failure_is_skipped_and_cleaned_up(fake_tools, dummy_model, monkeypatch):
    monkeypatch.setenv("FAKE_BENCH_MODE", "fail")
    r = rpc_lane.measure_rpc(dummy_model, threads=1, n_prompt=8, n_gen=4)
    assert r["skipped"] is True
    assert r["reason"].startswith("llama-bench over RPC failed (exit 1): error: failed to load model")
    assert "--rpc" in r["command"]
    _assert_gone(_server_pids(fake_tools))


def test_fake_lane_server_that_dies_at_start(fake_tools, dummy_model):
    (fake_tools / "ggml-rpc-server").write_text(f"#!{sys.executable}\nimport sys\n"
                                                "print('error: unknown device: CPU'); sys.exit(1)\n")
    r = rpc_lane.measure_rpc(dummy_model, threads=1, n_prompt=8, n_gen=4)
    assert r["skipped"] is True
    assert "could not start the rpc-servers" in r["reason"] and "unknown device: CPU" in r["reason"]


# --- real lane ----------------------------------------------------------------------------------

def _rpc_built() -> bool:
    b = REPO / "build" / "cpu-rpc" / "bin"
    return (b / "ggml-rpc-server").is_file() or (b / "rpc-server").is_file()


@pytest.mark.real
@pytest.mark.skipif(not _rpc_built(), reason="llama.cpp RPC tools not built (build/cpu-rpc): "
                                             "run `dgr build --rpc`")
def test_real_rpc_split_over_two_servers(smollm2_path):
    r = rpc_lane.measure_rpc(smollm2_path, threads=1, n_prompt=32, n_gen=16,
                             build_missing=False)   # never builds: CI must not compile llama.cpp twice
    assert r["skipped"] is False, r.get("reason")
    assert r["pp_tok_s"] > 0 and r["tg_tok_s"] > 0
    assert r["devices"] == "RPC0/RPC1" and r["tensor_split"] == "15/16"
    assert [s["layers"] for s in r["per_server"]] == [["0:15"], ["15:30"]]
    assert all(s["model_buffer_mib"] for s in r["per_server"])
    assert r["warnings"] == [], r["warnings"]
    assert all(d and all(x.startswith("CPU:") for x in d) for d in r["server_devices"].values())
