"""Console output: progress for long work (hashing, downloading, building) on stderr."""

from __future__ import annotations

import sys
import time


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
