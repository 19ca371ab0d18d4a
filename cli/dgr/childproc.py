"""Child processes that do not outlive the dgr process that started them.

A worker (or relay, benchmark server, gateway) that dgr starts is stopped by dgr's own cleanup
(``finally``/``__exit__``) on a normal exit, Ctrl-C or SIGTERM. When dgr dies without running it
(SIGKILL, the OOM killer, a crash), Linux's parent-death signal stops the child instead:
:func:`popen` arms ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` in the child before it executes, so the
child gets SIGTERM (a worker then drains and exits) the moment its parent goes.

The kernel sends that signal when the *thread* that forked the child ends, not the process.
A child started from a short-lived thread would be stopped with that thread, so :func:`popen`
forks from the main thread, or else from one daemon thread of this module that lives as long as
the process.

The signal survives ``execve`` (a wrapper script that ``exec``s the worker, ``ip netns exec``,
``taskset``), except into a set-user-ID or file-capability binary. Elsewhere than Linux
:func:`popen` is plain :class:`subprocess.Popen`.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Sequence

PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGTERM

_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def parent_death_preexec(sig: int = PARENT_DEATH_SIGNAL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that arms the parent-death signal (None where there is none). libc's
    ``prctl`` is resolved here, in the parent: the child of a threaded process (gRPC) must not
    load libraries. When the parent died before the signal was armed, the child exits at once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    getppid, exit_now = os.getppid, os._exit

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if getppid() != parent:
            exit_now(1)

    return preexec


def _spawn_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            # a plain daemon thread would do as well; the executor is the smallest "run this there
            # and give me the result" there is. Its one thread never exits before the process.
            _spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dgr-spawner")
        return _spawner


def popen(argv: Sequence[str], **kw: Any) -> subprocess.Popen:
    """:class:`subprocess.Popen` of a child that gets SIGTERM when this process dies."""
    pre = parent_death_preexec()
    if pre is None:
        return subprocess.Popen(argv, **kw)
    if "preexec_fn" in kw:
        raise TypeError("popen() sets preexec_fn itself")
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(argv, preexec_fn=pre, **kw)
    return _spawn_thread().submit(lambda: subprocess.Popen(argv, preexec_fn=pre, **kw)).result()
