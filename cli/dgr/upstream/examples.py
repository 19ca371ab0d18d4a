"""`dgr upstream check`: build the outreach example and tests against the patched pin, run them.

``upstream/outreach/examples/`` is a small CMake project that adds the patched llama.cpp tree
(``build/llama.cpp``, made from the pin and the series) as a static subproject; it is configured
in ``build/outreach-<backend>/`` with ccache, and only its own targets (and what they link) are
built. Every program then runs on synthetic models written by the same code as
``dgr gguf synth`` (an untied and a tied dense llama), on SmolLM2-135M when
MESHNET_ENABLE_REAL_INFERENCE_TESTS=1 and it is installed, and on any ``--model`` given.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .. import paths
from ..errors import DgrError
from . import build as build_mod
from .outreach import examples_dir

TARGET = "outreach-examples"
EXAMPLE = "llama-split-simple"
TESTS = ("test-layer-range", "test-range-mmap", "test-boundary-input", "test-boundary-output", "test-layer-kv")
REAL_ENV = "MESHNET_ENABLE_REAL_INFERENCE_TESTS"
# (label, layers, tied): six layers so that head, middle and tail ranges all exist
SYNTH_MODELS = (("synthetic llama, untied", 6, False), ("synthetic llama, tied", 6, True))
SYNTH_EMBD = 128


@dataclass(frozen=True)
class Result:
    program: str
    model: str          # label of the model it ran on
    ok: bool
    seconds: float
    summary: str        # the program's last line, or why it failed to run
    output: str         # stdout + stderr (tail), for the failure report


def build_dir(backend: str = "cpu") -> Path:
    return paths.build_dir() / f"outreach-{backend}"


def build(backend: str = "cpu", *, jobs: int | None = None) -> Path:
    """Configure (when needed) and build the examples; returns their bin folder."""
    flags = build_mod.check_toolchain(backend)
    paths.build_dir().mkdir(parents=True, exist_ok=True)
    with open(paths.build_dir() / f".build-outreach-{backend}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pin, tree, digest = build_mod._ensure_sources()
        bdir = build_dir(backend)
        bdir.mkdir(parents=True, exist_ok=True)
        config = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", f"-DLLAMA_SOURCE_DIR={tree}", *flags]
        # pin and series in the stamp: a new series reconfigures
        build_mod.cmake_build(examples_dir(), bdir, config, [TARGET], jobs=jobs,
                              stamp={"source": str(tree), "pin": pin.commit, "patches": digest})
        return bdir / "bin"


def synthetic_models(backend: str = "cpu") -> list[tuple[str, Path]]:
    """The synthetic models the check runs on (what `dgr gguf synth` writes; seeded, so stable)."""
    from ..gguf.synth import SynthSpec, synthesize

    out = []
    for label, layers, tied in SYNTH_MODELS:
        path = build_dir(backend) / "models" / f"synth-llama-{layers}l-{'tied' if tied else 'untied'}.gguf"
        spec = SynthSpec(arch="llama", n_layer=layers, n_embd=SYNTH_EMBD, n_ff=3 * SYNTH_EMBD, tied=tied, seed=7)
        synthesize(spec, path)
        out.append((label, path))
    return out


def real_model() -> tuple[str, Path] | None:
    """SmolLM2-135M when the real-model lane is on and the package is installed, else None."""
    if os.environ.get(REAL_ENV) != "1":
        return None
    from ..gguf.models import default_model_path

    try:
        return ("SmolLM2-135M Q4_1", default_model_path())
    except DgrError:
        return None


def _commands(bin_dir: Path, model: Path) -> list[tuple[str, list[str]]]:
    cmds = [(EXAMPLE, [str(bin_dir / EXAMPLE), "-m", str(model), "-n", "16", "-t", "2"])]
    cmds += [(t, [str(bin_dir / t), str(model)]) for t in TESTS]
    return cmds


def run(bin_dir: Path, models: list[tuple[str, Path]], *, timeout_s: float = 600.0) -> Iterator[Result]:
    """Run the example and every test on every model, one at a time, each bounded by timeout_s."""
    for label, model in models:
        if not model.is_file():
            raise DgrError(f"model {model} not found")
        for name, cmd in _commands(bin_dir, model):
            if not Path(cmd[0]).is_file():
                raise DgrError(f"{cmd[0]} not built", hint="run `dgr upstream check` (it builds first)")
            t0 = time.monotonic()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s)
            except subprocess.TimeoutExpired as exc:
                out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                yield Result(name, label, False, time.monotonic() - t0, f"timed out after {timeout_s:.0f} s", out[-4000:])
                continue
            out = proc.stdout + proc.stderr
            lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
            summary = lines[-1] if lines else f"exit {proc.returncode}"
            if proc.returncode != 0:
                fails = [ln for ln in proc.stderr.splitlines() if ln.startswith("FAIL")]
                summary = fails[0] if fails else f"exit {proc.returncode}: {summary}"
            yield Result(name, label, proc.returncode == 0, time.monotonic() - t0, summary, out[-4000:])
