"""Child processes that do not outlive the dgr process that started them.

A worker (or relay, benchmark server, gateway) that dgr starts is stopped by dgr's own cleanup
(``finally``/``__exit__``) on a normal exit, Ctrl-C or SIGTERM. When dgr dies without running it
(SIGKILL, the OOM killer, a crash), Linux's parent-death signal stops the child instead:
:func:`popen` arms ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` for the child (through util-linux's
``setpriv --pdeathsig``, which then executes it), so the child gets SIGTERM (a worker then drains and exits) the moment its parent goes.

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
import shutil
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Sequence

PARENT_DEATH_SIGNAL = signal.SIGTERM

_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _spawn_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            # a plain daemon thread would do as well; the executor is the smallest "run this there
            # and give me the result" there is. Its one thread never exits before the process.
            _spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dgr-spawner")
        return _spawner


def _setpriv() -> str | None:
    """util-linux's ``setpriv`` (essential on Debian and Ubuntu), which arms the signal and then
    executes the child: no Python code runs between fork and exec."""
    global _SETPRIV
    if _SETPRIV is None:
        found = shutil.which("setpriv") if sys.platform.startswith("linux") else None
        _SETPRIV = found or ""
    return _SETPRIV or None


_SETPRIV: str | None = None


def popen(argv: Sequence[str], **kw: Any) -> subprocess.Popen:
    """:class:`subprocess.Popen` of a child that gets SIGTERM when this process dies.

    The signal is armed by ``setpriv --pdeathsig TERM -- ARGV`` (same PID: setpriv executes the
    child), not by a ``preexec_fn``: a ``preexec_fn`` makes Python fork() instead of vfork(),
    and in a process that runs gRPC the fork handlers then start gRPC's poller in the child,
    which aborts ("epoll_wait error: Bad file descriptor") once the child closes its inherited
    descriptors before executing. Without setpriv the child is started plainly (no signal)."""
    if "preexec_fn" in kw:
        raise TypeError("popen() arms the parent-death signal itself; no preexec_fn")
    tool = _setpriv()
    if tool is None:
        return subprocess.Popen(argv, **kw)
    cmd = [tool, "--pdeathsig", signal.Signals(PARENT_DEATH_SIGNAL).name[3:], "--", *map(str, argv)]
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(cmd, **kw)
    return _spawn_thread().submit(lambda: subprocess.Popen(cmd, **kw)).result()
