"""Co-located Shards of a local route share one CPU set when they have fewer threads than the
host's CPUs (dgr.route.local.shared_cpus / pin_process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dgr.route.local import pin_process, shared_cpus

ALLOWED = sorted(os.sched_getaffinity(0))


def test_shards_taking_turns_share_the_first_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3, 1, 2, 0})
    assert shared_cpus(2, 1) == [0]
    assert shared_cpus(3, 2) == [0, 1]
    # left alone: one shard, threads covering every CPU, no thread count, the fake model
    assert shared_cpus(1, 1) == []
    assert shared_cpus(2, 4) == [] and shared_cpus(2, 8) == []
    assert shared_cpus(2, None) == [] and shared_cpus(2, 0) == []
    assert shared_cpus(2, 1, fake=True) == []


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs to see a pinned process differ")
def test_pin_process_moves_every_thread_of_a_child():
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(100):      # both threads started (bounded)
            if len(os.listdir(f"/proc/{p.pid}/task")) >= 2:
                break
            time.sleep(0.02)
        pin_process(p.pid, [ALLOWED[-1]])
        tids = [int(t) for t in os.listdir(f"/proc/{p.pid}/task")]
        assert len(tids) >= 2 and all(os.sched_getaffinity(t) == {ALLOWED[-1]} for t in tids)
    finally:
        p.kill()
        p.wait()
    pin_process(p.pid, [ALLOWED[0]])        # a process that is gone: nothing raised
