"""The compute device a worker reports (GetCapabilityResponse.device, docs/backends.md "Devices
and device classes") and device (VRAM) admission, on the fake model: its device class (``cpu``
by default, or ``--fake-device-class``), its memory (the host's RAM, or
``--fake-device-memory-mb``), the predicted need (``--fake-device-need-mb``), the
``dgr_device_memory_*_bytes`` metrics, the refused start when the need exceeds the memory, and
the refusals of the options themselves."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from fakeroute import start_fake

pytestmark = pytest.mark.native

MIB = 1 << 20


def _serve(native_bin: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(native_bin / "dgr-worker"), "serve", "--listen", "127.0.0.1:0", *args],
                          capture_output=True, text=True, timeout=60)


def _host_mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def test_the_default_fake_device_is_the_cpu_with_the_hosts_ram(native_bin: Path) -> None:
    with start_fake(native_bin) as w:
        d = w.client().capability().device
        assert (d.device_class, d.backend, d.memory_predicted_bytes) == ("cpu", "cpu", 0)
        assert d.memory_total_bytes == _host_mem_total() > 0
        assert 0 < d.memory_free_bytes <= d.memory_total_bytes


def test_a_named_device_class_memory_and_need_are_reported(native_bin: Path) -> None:
    args = ("--fake-device-class", "vulkan:llvmpipe", "--fake-device-memory-mb", "4096", "--fake-device-need-mb", "1024",
            "--metrics-listen", "127.0.0.1:0")
    with start_fake(native_bin, *args) as w:
        c = w.client()
        d = c.capability().device
        assert (d.device_class, d.backend) == ("vulkan:llvmpipe", "vulkan")
        assert d.memory_total_bytes == d.memory_free_bytes == 4096 * MIB
        assert d.memory_predicted_bytes == 1024 * MIB
        # GetMetrics and the Prometheus text, labelled with the class
        cls = {"device_class": "vulkan:llvmpipe"}
        assert c.metric("dgr_device_memory_total_bytes", **cls) == 4096 * MIB
        assert c.metric("dgr_device_memory_free_bytes", **cls) == 4096 * MIB
        assert c.metric("dgr_device_memory_predicted_bytes", **cls) == 1024 * MIB
        text = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5).read().decode()
        for name, value in (("total", 4096 * MIB), ("free", 4096 * MIB), ("predicted", 1024 * MIB)):
            m = re.search(rf'^dgr_device_memory_{name}_bytes\{{device_class="vulkan:llvmpipe"\}} (\S+)$', text, re.M)
            assert m and float(m.group(1)) == value, (name, text[:2000])


def test_the_free_memory_is_read_again_when_asked(native_bin: Path) -> None:
    with start_fake(native_bin, "--fake-device-class", "cuda:sm_90") as w:
        c = w.client()
        assert c.capability().device.device_class == "cuda:sm_90"
        free = c.metric("dgr_device_memory_free_bytes", device_class="cuda:sm_90")
        total = c.metric("dgr_device_memory_total_bytes", device_class="cuda:sm_90")
        assert 0 < free <= total == _host_mem_total()


def test_a_need_above_the_device_memory_is_refused_at_start(native_bin: Path) -> None:
    r = _serve(native_bin, "--fake-model", "--fake-device-class", "cuda:sm_90", "--fake-device-memory-mb", "2048",
               "--fake-device-need-mb", "3000")
    assert r.returncode == 2, r.stderr
    errs = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errs) == 1 and "refusing to load" in errs[0], r.stderr
    assert "3000.0 MiB" in errs[0] and "free memory of 2048.0 MiB" in errs[0] and "(cuda:sm_90)" in errs[0]
    assert "weights" in errs[0] and "KV" in errs[0] and "compute" in errs[0]
    assert "dgr-worker: serving" not in r.stdout
    # a need that fits, and a need without a memory figure, start
    with start_fake(native_bin, "--fake-device-memory-mb", "2048", "--fake-device-need-mb", "2048") as w:
        assert w.client().capability().device.memory_predicted_bytes == 2048 * MIB


@pytest.mark.parametrize("args, message", [
    (["--model", "m.gguf", "--fake-device-class", "cpu"], "need --fake-model"),
    (["--model", "m.gguf", "--fake-device-memory-mb", "64"], "need --fake-model"),
    (["--model", "m.gguf", "--fake-device-need-mb", "64"], "need --fake-model"),
    (["--fake-model", "--fake-device-class", "Vulkan NVIDIA"], "--fake-device-class wants 1..64 characters"),
    (["--fake-model", "--fake-device-class", "x" * 65], "--fake-device-class wants 1..64 characters"),
    (["--fake-model", "--fake-device-memory-mb", "-1"], "--fake-device-memory-mb wants"),
    (["--fake-model", "--fake-device-need-mb", "16777217"], "--fake-device-need-mb wants 0 .. 16777216"),
])
def test_the_device_options_are_refused_where_they_do_not_apply(native_bin: Path, args: list[str], message: str) -> None:
    r = _serve(native_bin, *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_the_device_options_are_rows_of_the_option_table(native_bin: Path) -> None:
    r = subprocess.run([str(native_bin / "dgr-worker"), "options", "--json"], capture_output=True, text=True, timeout=30)
    t = {o["name"]: o for o in json.loads(r.stdout)["options"]}
    assert t["fake-device-class"]["default"] == "cpu" and t["fake-device-class"]["kind"] == "text"
    for name in ("fake-device-memory-mb", "fake-device-need-mb"):
        assert (t[name]["default"], t[name]["min"], t[name]["max"]) == (0, 0, 16777216), t[name]
