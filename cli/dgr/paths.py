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


def refuse_home(path: Path, what: str = "model path") -> Path:
    """``path`` resolved; a path under /home (where model artifacts are not allowed) is refused."""
    from .errors import DgrError

    resolved = Path(path).expanduser().resolve()
    if resolved == Path("/home") or Path("/home") in resolved.parents:
        raise DgrError(f"{what} {resolved} is under /home, where model artifacts are not allowed",
                       hint="set DGR_MODEL_DIR to a folder outside /home")
    return resolved
