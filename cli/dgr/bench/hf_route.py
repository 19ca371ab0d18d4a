"""The distributed safetensors route on this host: one :mod:`dgr.bench.hf_worker` process per
layer range (free loopback ports), and the whole Transformers model as the parity reference.

    with HfRoute(hf_dir, [(0, 15), (15, 30)], threads=1) as r:
        asyncio.run(run_sessions(r.endpoints, ...))

Needs the ``baseline`` extra (torch, transformers, safetensors) in the workers' interpreter.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from .. import childproc
from ..errors import DgrError
from ..procfs import status_bytes

_LISTEN = re.compile(r"listening on (\S+):(\d+)")
READY_TIMEOUT_S = 300.0


class HfWorkerProcess:
    """One ``python -m dgr.bench.hf_worker`` process."""

    def __init__(self, cmd: list[str], *, ready_timeout: float = READY_TIMEOUT_S) -> None:
        self.cmd = cmd
        self.proc = childproc.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.endpoint = ""
        self.stderr_lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        end = time.monotonic() + ready_timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                tail = " | ".join(self.stderr_lines[-5:])
                raise DgrError(f"transformers shard worker did not start ({' '.join(cmd[3:])}): {tail or 'timeout'}")

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            m = _LISTEN.search(raw.decode(errors="replace"))
            if m:
                self.endpoint = f"{m.group(1)}:{m.group(2)}"
            if raw.startswith(b"dgr-hf-worker: serving"):
                self._ready.set()

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            self.stderr_lines.append(raw.decode(errors="replace").rstrip())
            del self.stderr_lines[:-200]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        return status_bytes(self.proc.pid, "VmRSS")

    def peak_rss_bytes(self) -> int:
        return status_bytes(self.proc.pid, "VmHWM")

    def kill(self) -> None:
        from ..route.supervisor import stop_child

        stop_child(self.proc, 10)


class HfRoute:
    """One transformers shard worker per range of ``split``, started in order (each loads only
    its own tensors); stopped on exit."""

    def __init__(self, model_dir: Path, split: Sequence[tuple[int, int]], *, threads: int = 0, max_sessions: int = 8,
                 ctx_per_session: int = 1024, dtype: str = "fp32", artifact_id: str = "") -> None:
        self.model_dir, self.split = Path(model_dir), list(split)
        self.threads, self.max_sessions, self.ctx, self.dtype = threads, max_sessions, ctx_per_session, dtype
        self.artifact_id = artifact_id
        self.workers: list[HfWorkerProcess] = []

    def __enter__(self) -> "HfRoute":
        try:
            for a, b in self.split:
                cmd = [sys.executable, "-m", "dgr.bench.hf_worker", "--model-dir", str(self.model_dir),
                       "--layers", f"{a}:{b}", "--max-sessions", str(self.max_sessions),
                       "--ctx-per-session", str(self.ctx), "--dtype", self.dtype]
                if self.threads:
                    cmd += ["--threads", str(self.threads)]
                if self.artifact_id:
                    cmd += ["--artifact-id", self.artifact_id]
                self.workers.append(HfWorkerProcess(cmd))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for w in self.workers:
            w.kill()

    @property
    def endpoints(self) -> list[str]:
        return [w.endpoint for w in self.workers]

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]


def whole_model_greedy(model_dir: Path, prompts: Sequence[Sequence[int]], n: int, *, top: int = 0,
                       threads: int = 0) -> list[dict[str, Any]]:
    """The whole Transformers model (``from_pretrained``, fp32, sdpa), greedy, ``n`` tokens per
    prompt with a KV cache: the reference the safetensors route must reproduce. Returns per
    prompt ``{"tokens": [...], "top": [[(id, logprob), ...] per token]}``."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([list(p)], dtype=torch.long)
            past = None
            toks: list[int] = []
            tops: list[list[tuple[int, float]]] = []
            for _ in range(n):
                r = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = r.past_key_values
                lp = torch.log_softmax(r.logits[0, -1].double(), dim=-1)
                t = int(torch.argmax(lp))
                toks.append(t)
                if top:
                    v, i = torch.topk(lp, top)
                    tops.append([(int(a), float(b)) for a, b in zip(i, v)])
                ids = torch.tensor([[t]], dtype=torch.long)
            out.append({"tokens": toks, "top": tops})
    return out
