"""dgr.childproc: children armed with the parent-death signal, bound to the process, not to the
thread that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dgr import childproc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# a child that prints its own parent-death signal, then waits for stdin to close and exits 0
CHILD = ("import ctypes, sys; s = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(s), 0, 0, 0); "
         "print(s.value, flush=True); sys.stdin.read()")


def _start() -> subprocess.Popen:
    return childproc.popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_child_gets_sigterm_when_dgr_dies():
    p = _start()
    try:
        assert int(p.stdout.readline()) == int(signal.SIGTERM)
    finally:
        p.stdin.close()
        assert p.wait(30) == 0


def test_a_child_started_from_a_short_lived_thread_outlives_that_thread():
    """The kernel's "parent" is the forking thread: a child started from a thread that then ends
    must not be stopped with it (dgr.childproc forks from a thread that lives as long as the
    process)."""
    box: dict = {}

    def start() -> None:
        box["tid"] = threading.get_native_id()
        box["p"] = _start()
    t = threading.Thread(target=start)
    t.start()
    t.join()
    p = box["p"]
    try:
        assert int(p.stdout.readline()) == int(signal.SIGTERM)
        # the thread has ended in the kernel too (any parent-death signal bound to it is sent by then)
        end = time.monotonic() + 10
        while Path(f"/proc/self/task/{box['tid']}").exists():
            assert time.monotonic() < end, "the thread never ended"
            time.sleep(0.01)
    finally:
        p.stdin.close()
        code = p.wait(30)
    assert code == 0, f"the child ended with {code} (-15: stopped with the thread that started it)"
    assert os.getpid() != p.pid
