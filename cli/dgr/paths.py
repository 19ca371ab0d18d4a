"""Where things live: the repository root, build outputs and the pin cache."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def repo_root() -> Path:
    """The dgr source checkout (dgr is installed editable from it).

    DGR_REPO_ROOT overrides; otherwise the folder two levels above this package
    (``cli/dgr`` -> repository root) when it holds ``upstream/llama.cpp.pin``.
    """
    env = os.environ.get("DGR_REPO_ROOT")
    if env:
        return Path(env).resolve()
    candidate = PACKAGE_DIR.parent.parent
    if (candidate / "upstream" / "llama.cpp.pin").is_file():
        return candidate
    from .errors import DgrError

    raise DgrError(
        f"cannot find the dgr checkout above {PACKAGE_DIR}",
        hint="install dgr editable from a clone (pip install -e .) or set DGR_REPO_ROOT",
    )


def build_dir() -> Path:
    """All generated output; DGR_BUILD_DIR overrides ``<repo>/build``."""
    env = os.environ.get("DGR_BUILD_DIR")
    return Path(env).resolve() if env else repo_root() / "build"


def pin_file() -> Path:
    return repo_root() / "upstream" / "llama.cpp.pin"


def patches_dir() -> Path:
    return repo_root() / "upstream" / "patches"


def pin_cache_dir() -> Path:
    """Where the pinned source archive is downloaded and extracted (DGR_PIN_CACHE overrides)."""
    env = os.environ.get("DGR_PIN_CACHE")
    return Path(env).resolve() if env else build_dir() / "pin"


def patched_source_dir() -> Path:
    """The git working tree of the pinned source with the patch series applied."""
    env = os.environ.get("DGR_LLAMA_SRC")
    return Path(env).resolve() if env else build_dir() / "llama.cpp"


def backend_build_dir(backend: str) -> Path:
    return build_dir() / backend
