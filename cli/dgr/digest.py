"""The sha256 of a file, read in blocks (``hashlib.file_digest``): one helper for every place
that checks or records a file's hash (bundles, downloaded packages, models, baseline artifacts).
The pin's archive check keeps its own, which shows progress on a large download."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path | str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
