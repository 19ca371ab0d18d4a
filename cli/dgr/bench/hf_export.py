"""The artifacts of the DGR-001 baseline, all made from one source GGUF's weights.

1. safetensors: Transformers dequantizes the GGUF (``from_pretrained(dir, gguf_file=...)``) and
   the weights are saved with ``save_pretrained`` next to the tokenizer; its sha256 is recorded.
2. F32 GGUF: converted from those safetensors with the pinned ``convert_hf_to_gguf.py`` (quality lane).
3. Q8_0 and Q4_1 GGUF: quantized from the F32 GGUF with the pinned ``llama-quantize`` (performance lane).

Step 1 needs torch and transformers (the ``baseline`` extra) and runs in a child process
(``python -m dgr.bench.hf_export export ...``) so this module imports neither at the top.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ..upstream import build
from .. import paths
from ..digest import sha256_file
from ..errors import DgrError
from .llama_lane import CommandLog, run_measured

_log = logging.getLogger(__name__)

QUANT_TYPES = ("Q8_0", "Q4_1")
MANIFEST = "baseline-artifacts.json"
MANIFEST_VERSION = 1


def require_baseline_extra() -> None:
    import importlib.util

    missing = [m for m in ("torch", "transformers", "safetensors", "accelerate", "sentencepiece", "tokenizers")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise DgrError(f"the transformers baseline needs {', '.join(missing)}",
                       hint="pip install torch==2.13.0 first (CPU wheel), then pip install -e '.[baseline]'")


def _describe(path: Path, sha: str | None = None) -> dict[str, Any]:
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha or sha256_file(path)}


def _safetensors_bytes(hf_dir: Path) -> int:
    return sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))


def _safetensors_sha(hf_dir: Path) -> str:
    files = sorted(hf_dir.glob("*.safetensors"))
    if len(files) == 1:
        return sha256_file(files[0])
    h = hashlib.sha256()  # several shards: hash of "name sha" lines
    for f in files:
        h.update(f"{f.name} {sha256_file(f)}\n".encode())
    return h.hexdigest()


def prepare(source: Path, root: Path, *, threads: int, log: CommandLog) -> dict[str, Any]:
    """Make (or reuse, when the manifest matches the source hash) every baseline artifact under
    ``root``; returns the manifest (paths relative to ``root``)."""
    require_baseline_extra()
    root.mkdir(parents=True, exist_ok=True)
    src_sha = sha256_file(source)
    manifest_path = root / MANIFEST
    if manifest_path.is_file():
        m = json.loads(manifest_path.read_text())
        if (m.get("version") == MANIFEST_VERSION and m.get("source", {}).get("sha256") == src_sha
                and all((root / a["path"]).exists() for a in m["artifacts"].values())):
            _log.info(f"reusing baseline artifacts in {root}")
            return m
    hf_dir = root / "hf"
    _log.info(f"dequantizing {source.name} into safetensors ({hf_dir})")
    r = run_measured([sys.executable, "-m", "dgr.bench.hf_export", "export", "--gguf", source, "--out", hf_dir],
                     env={"HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}, log=log)
    if r.returncode != 0:
        raise DgrError(f"safetensors export failed: {r.stderr.strip()[-500:]}")
    info = json.loads((hf_dir / "dgr-export.json").read_text())
    f32 = root / "model-f32.gguf"
    _log.info("converting the safetensors to an F32 GGUF with the pinned convert_hf_to_gguf.py")
    src_tree = paths.patched_source_dir()
    conv = src_tree / "convert_hf_to_gguf.py"
    if not conv.is_file():
        raise DgrError(f"{conv} not found", hint="run `dgr patches apply` (the pinned llama.cpp tree)")
    r = run_measured([sys.executable, conv, hf_dir, "--outtype", "f32", "--outfile", f32],
                     env={"PYTHONPATH": str(src_tree / "gguf-py"), "HF_HUB_OFFLINE": "1"},
                     log=log)
    if r.returncode != 0 or not f32.is_file():
        raise DgrError(f"convert_hf_to_gguf.py failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
    quantize = build.tool_binary("llama-quantize")
    artifacts: dict[str, Any] = {
        "safetensors": {"path": "hf", "bytes": _safetensors_bytes(hf_dir), "sha256": _safetensors_sha(hf_dir),
                        "format": "safetensors (save_pretrained, fp32)"},
        "gguf-f32": {"path": f32.name, **_describe(f32), "made_by": "convert_hf_to_gguf.py --outtype f32"},
    }
    for qt in QUANT_TYPES:
        out = root / f"model-{qt.lower()}.gguf"
        _log.info(f"quantizing {qt} with the pinned llama-quantize")
        r = run_measured([quantize, f32, out, qt, str(threads)], log=log)
        if r.returncode != 0 or not out.is_file():
            raise DgrError(f"llama-quantize {qt} failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
        artifacts[f"gguf-{qt.lower()}"] = {"path": out.name, **_describe(out), "made_by": f"llama-quantize {qt}"}
    manifest = {"version": MANIFEST_VERSION,
                "source": {"file": source.name, "bytes": source.stat().st_size, "sha256": src_sha},
                "model": info, "artifacts": artifacts}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---- child process: runs with torch + transformers -----------------------------------------

def _export(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")  # dequantized: a plain fp32 checkpoint from here on
    # a GGUF-loaded model refuses save_pretrained; copy the dequantized weights into a plain one
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    info = {"architecture": cfg.model_type, "n_layer": cfg.num_hidden_layers, "n_embd": cfg.hidden_size,
            "n_head": cfg.num_attention_heads, "n_head_kv": cfg.num_key_value_heads, "n_vocab": cfg.vocab_size,
            "tied_embeddings": bool(cfg.tie_word_embeddings),
            "parameters": int(sum(p.numel() for p in model.parameters()))}
    (out / "dgr-export.json").write_text(json.dumps(info, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgr.bench.hf_export")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="dequantize a GGUF into a safetensors checkpoint")
    ex.add_argument("--gguf", type=Path, required=True)
    ex.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.cmd == "export":
        _export(args.gguf, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
