"""Console output on stderr: log setup for the `dgr` command and progress for long work.

Logic modules log through ``logging.getLogger(__name__)``; results a command prints go to
stdout and never through logging. :func:`setup_logging` is called once by the root command:
``-q`` shows warnings and errors only, the default adds info lines, ``-v`` adds debug lines.
"""

from __future__ import annotations

import logging
import sys
import time

# The loggers the command configures (third-party libraries keep their own defaults).
PROJECT_LOGGERS = ("dgr", "meshnet_adapter")


def verbosity_level(verbose: bool, quiet: bool) -> int:
    """The logging level for ``-v``/``-q`` (``-q`` wins when both are given)."""
    if quiet:
        return logging.WARNING
    return logging.DEBUG if verbose else logging.INFO


class _StderrHandler(logging.StreamHandler):
    """Plain lines to whatever ``sys.stderr`` is at emit time (test runners swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(level: int = logging.INFO) -> None:
    """Send log records to stderr: rich's handler on a terminal, plain lines otherwise (so CI
    logs and evidence transcripts stay one record per line). The handler sits on the root
    logger; only the project's loggers get ``level`` (third-party libraries keep warnings)."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(
            console=Console(stderr=True), show_time=False, show_path=level <= logging.DEBUG,
            markup=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = _StderrHandler(sys.stderr)
        fmt = "%(levelname)s %(name)s: %(message)s" if level <= logging.DEBUG else "%(message)s"
        handler.setFormatter(logging.Formatter(fmt))
    handler.set_name("dgr-console")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "dgr-console"]:
        root.removeHandler(old)
    root.addHandler(handler)
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(level)


class Progress:
    """A minimal byte/step progress line; silent when stderr is not a terminal
    except for a final summary line, so logs stay readable in CI."""

    def __init__(self, label: str, total: int | None = None, unit: str = "B") -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self._start = time.monotonic()

    def _fmt(self, n: float) -> str:
        if self.unit != "B":
            return f"{int(n)}"
        for suffix in ("B", "KiB", "MiB", "GiB"):
            if n < 1024 or suffix == "GiB":
                return f"{n:.1f} {suffix}" if suffix != "B" else f"{int(n)} B"
            n /= 1024
        return f"{n:.1f} GiB"

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self._tty and now - self._last > 0.2:
            self._last = now
            tot = f" / {self._fmt(self.total)}" if self.total else ""
            sys.stderr.write(f"\r{self.label}: {self._fmt(self.done)}{tot}")
            sys.stderr.flush()

    def close(self) -> None:
        elapsed = time.monotonic() - self._start
        end = "\r" if self._tty else ""
        sys.stderr.write(f"{end}{self.label}: {self._fmt(self.done)} in {elapsed:.1f}s\n")
        sys.stderr.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
