"""Run Inference Routes locally: start one dgr-worker per Shard of a split, run Route Sessions
concurrently through :class:`meshnet_adapter.route_driver.RouteDriver`, stream text, collect
metrics, and compare with the whole model (greedy parity).

Used by ``dgr route run|generate``, ``dgr demo``, ``dgr bench route`` and ``dgr accept DGR-010``.
No Typer here.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import DgrError
from .llama_whole import WholeLlama

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "Explain what a transformer layer does, in two sentences.",
)
COLOCATED_SPINCOUNT = "10000"
CHATML = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


# ---- splits and local workers ------------------------------------------------------------

def parse_split(text: str) -> list[tuple[int, int]]:
    """``"0:15,15:30"`` -> [(0, 15), (15, 30)]; must be contiguous from 0."""
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        try:
            a, b = (int(x) for x in part.strip().split(":"))
        except ValueError:
            raise DgrError(f"bad split {text!r}", hint="write START:END,START:END,… e.g. 0:15,15:30") from None
        if a < 0 or b <= a:
            raise DgrError(f"bad shard range {part!r} in the split: need 0 <= START < END")
        out.append((a, b))
    pos = 0
    for a, b in out:
        if a != pos:
            raise DgrError(f"split {text!r} is not contiguous at layer {pos}", hint="ranges must chain: 0:A,A:B,…")
        pos = b
    return out


def model_n_layer(model: Path) -> int:
    from .gguf_inspect import open_gguf

    with open_gguf(model) as gf:
        return int(gf.n_layer)


@dataclass
class WorkerStats:
    range: str
    endpoint: str
    pid: int
    rss_bytes: int = 0
    rss_peak_bytes: int = 0
    kv_cells_total: int = 0
    kv_cells_peak: int = 0
    kv_bytes_per_cell: int = 0
    active_sessions_peak: int = 0
    steps: int = 0
    batches: int = 0
    batch_rows: int = 0
    queue_wait_s: float = 0.0
    queue_waits: int = 0
    step_latency_s: float = 0.0
    step_count: int = 0
    sessions_left: int = 0
    kv_cells_left: int = 0

    @property
    def mean_batch_rows(self) -> float:
        return self.batch_rows / self.batches if self.batches else 0.0

    @property
    def mean_queue_wait_s(self) -> float:
        return self.queue_wait_s / self.queue_waits if self.queue_waits else 0.0

    @property
    def kv_peak_bytes(self) -> int:
        return self.kv_cells_peak * self.kv_bytes_per_cell

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(mean_batch_rows=self.mean_batch_rows, mean_queue_wait_s=self.mean_queue_wait_s,
                 kv_peak_bytes=self.kv_peak_bytes)
        return d


def kv_bytes_per_cell(model: Path, start: int, end: int, kv_dtype_bytes: int = 2) -> int:
    """K and V bytes one cached position costs for layers [start, end) (f16 KV by default)."""
    from .gguf_inspect import open_gguf

    try:
        with open_gguf(model) as gf:
            n_embd = int(gf.hparam("embedding_length"))
            n_head = int(gf.hparam("attention.head_count"))
            n_head_kv = int(gf.hparam("attention.head_count_kv", n_head))
    except Exception:
        return 0
    return 2 * (end - start) * (n_embd // n_head) * n_head_kv * kv_dtype_bytes


class LocalRoute:
    """One dgr-worker process per Shard of ``split`` on 127.0.0.1 (free ports).

    ``fake=True`` serves the deterministic fake model (tests); ``slices=True`` first writes
    per-range slice files (``dgr gguf slice``) so each worker maps only its own tensors.
    """

    def __init__(self, model: Path | None, split: Sequence[tuple[int, int]], *, fake: bool = False,
                 slices: bool = False, threads: int | None = None, max_sessions: int = 8,
                 ctx_per_session: int = 2048, extra_args: Sequence[str] = (), backend: str = "cpu",
                 slice_dir: Path | None = None, log: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.model = model
        self.split = list(split)
        self.fake = fake
        self.slices = slices
        self.threads = threads
        self.max_sessions = max_sessions
        self.ctx_per_session = ctx_per_session
        self.extra_args = list(extra_args)
        self.backend = backend
        self.slice_dir = slice_dir
        self.log = log or (lambda _m: None)
        self.workers: list[Any] = []
        self.files: list[Path] = []
        self.fingerprint = ""
        self.artifact_id = ""
        # Co-located shards: libgomp's idle threads spin (~300k rounds) after every parallel region
        # and steal the cores the next shard computes on; a short spin keeps the hand-off cheap
        # (measured on 2 cores, SmolLM2 0:15|15:30: single-session decode 0.53 -> ~0.88 of the
        # whole model). An explicit GOMP_SPINCOUNT in the environment wins.
        self.env = dict(env or {})
        if len(self.split) > 1 and "GOMP_SPINCOUNT" not in os.environ:
            self.env.setdefault("GOMP_SPINCOUNT", COLOCATED_SPINCOUNT)

    def _args(self, i: int) -> list[str]:
        a, b = self.split[i]
        args = ["--layers", f"{a}:{b}", "--max-sessions", str(self.max_sessions),
                "--ctx-per-session", str(self.ctx_per_session)]
        if self.fake:
            n_layer = self.split[-1][1]
            return ["--fake-model", "--n-layer", str(n_layer), *args, *self.extra_args]
        args = ["--model", str(self.files[i]), *args, "--fingerprint", self.fingerprint,
                "--artifact-id", self.artifact_id]
        if self.threads:
            args += ["--threads", str(self.threads)]
        return args + self.extra_args

    def _prepare_model(self) -> None:
        from .recipe import recipe_for

        assert self.model is not None
        recipe = recipe_for(self.model, backend=self.backend, progress=False)
        self.fingerprint, self.artifact_id = recipe.fingerprint(), recipe.artifact_id
        if not self.slices:
            self.files = [self.model] * len(self.split)
            return
        from .gguf_slice import LayerRange, slice_gguf

        out_dir = self.slice_dir or Path(tempfile.gettempdir()) / "dgr-slices" / self.artifact_id[:16]
        out_dir.mkdir(parents=True, exist_ok=True)
        for a, b in self.split:
            path = out_dir / f"{self.model.stem}.{a}-{b}.gguf"
            if not path.is_file():
                self.log(f"slicing layers {a}:{b} -> {path}")
                slice_gguf(self.model, LayerRange(a, b), path, progress=False)
            self.files.append(path)

    def start(self) -> list[str]:
        from meshnet_adapter.worker_process import WorkerProcess, WorkerStartError

        from .build import worker_binary

        binary = worker_binary(self.backend)
        if not self.fake:
            self._prepare_model()
        try:
            for i, (a, b) in enumerate(self.split):
                try:
                    self.workers.append(WorkerProcess.start(self._args(i), binary=binary, ready_timeout=120,
                                                            env=self.env))
                except WorkerStartError as exc:
                    raise DgrError(f"worker for layers {a}:{b} did not start: {exc}") from None
                self.log(f"worker [{a}:{b}) pid {self.workers[-1].pid} on {self.workers[-1].target}")
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    @property
    def endpoints(self) -> list[str]:
        return [w.target for w in self.workers]

    def stop(self) -> None:
        for w in self.workers:
            try:
                w.terminate(10)
            except Exception:
                w.kill()

    def __enter__(self) -> "LocalRoute":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> list[WorkerStats]:
        out = []
        for (a, b), w in zip(self.split, self.workers):
            st = WorkerStats(f"{a}:{b}", w.target, w.pid)
            st.kv_bytes_per_cell = 0 if self.fake or self.model is None else kv_bytes_per_cell(self.model, a, b)
            out.append(st)
        return out


# ---- running sessions ---------------------------------------------------------------------

@dataclass
class SessionReport:
    index: int
    prompt: str
    prompt_tokens: int
    tokens: list[int]
    text: str
    finish_reason: str
    status: str
    error: str | None
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    decode_start_s: float      # since the run started
    decode_end_s: float
    seam_bytes_per_decode_token: list[float]   # per seam (request frame bytes into shard i+1; chained
                                               # mode: the route's figure, measured on the workers)
    hop_decode_rtt_s: list[float]               # per shard, mean decode round trip
    telemetry: dict[str, Any]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)   # arrival of each token, since the run started


@dataclass
class RunReport:
    label: str
    route: list[str]
    sessions: list[SessionReport]
    wall_s: float
    workers: list[WorkerStats] = field(default_factory=list)
    driver_cpu_s: float = 0.0
    mode: str = "stepwise"               # "chained" (head forwards, worker-side generation) or "stepwise"
    # chained mode, per seam: serialized decode frame bytes a worker sent downstream per decode
    # frame (dgr_chain_frame_bytes_sent_total / dgr_chain_frames_sent_total, phase="decode")
    chain_seam_bytes_per_decode_token: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.error is None for s in self.sessions)

    @property
    def aggregate_decode_tok_s(self) -> float:
        n = sum(max(0, len(s.tokens) - 1) for s in self.sessions if s.error is None)
        ok = [s for s in self.sessions if s.error is None]
        if not ok:
            return 0.0
        window = max(s.decode_end_s for s in ok) - min(s.decode_start_s for s in ok)
        return n / window if window > 0 else 0.0

    @property
    def concurrent_decode_tok_s(self) -> float:
        """Aggregate decode rate while every session was decoding (what llama-batched-bench's
        S_TG measures: all B sequences decode together): tokens that arrived after the latest
        first token and up to the earliest last token, over that window. 0 when the sessions
        never decoded at the same time (staggered prefills, short answers)."""
        ok = [s for s in self.sessions if s.error is None]
        if not ok or any(len(s.token_times_s) < 2 for s in ok):
            return 0.0
        a = max(s.token_times_s[0] for s in ok)
        b = min(s.token_times_s[-1] for s in ok)
        if b <= a:
            return 0.0
        return sum(1 for s in ok for t in s.token_times_s if a < t <= b) / (b - a)

    @property
    def aggregate_prefill_tok_s(self) -> float:
        ok = [s for s in self.sessions if s.error is None]
        if not ok:
            return 0.0
        return sum(s.prompt_tokens for s in ok) / max(s.decode_start_s for s in ok)

    @property
    def mean_ttft_s(self) -> float:
        ok = [s for s in self.sessions if s.error is None]
        return sum(s.ttft_s for s in ok) / len(ok) if ok else 0.0

    @property
    def hop_decode_rtt_s(self) -> list[float]:
        """Per hop of the route, the mean decode round trip over the sessions that completed (chained
        mode: hop 0 timed by the driver, hop i by worker i on its downstream link)."""
        ok = [s.hop_decode_rtt_s for s in self.sessions if s.error is None and s.hop_decode_rtt_s]
        if not ok:
            return []
        n = min(len(h) for h in ok)
        return [sum(h[i] for h in ok) / len(ok) for i in range(n)]

    @property
    def seam_bytes_per_decode_token(self) -> float:
        if self.chain_seam_bytes_per_decode_token:
            vals = [v for v in self.chain_seam_bytes_per_decode_token if v]
            return sum(vals) / len(vals) if vals else 0.0
        vals = [v for s in self.sessions for v in s.seam_bytes_per_decode_token if v]
        return sum(vals) / len(vals) if vals else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label, "route": self.route, "mode": self.mode, "wall_s": self.wall_s, "ok": self.ok,
            "aggregate_decode_tok_s": self.aggregate_decode_tok_s,
            "concurrent_decode_tok_s": self.concurrent_decode_tok_s,
            "aggregate_prefill_tok_s": self.aggregate_prefill_tok_s,
            "mean_ttft_s": self.mean_ttft_s,
            "seam_bytes_per_decode_token": self.seam_bytes_per_decode_token,
            "chain_seam_bytes_per_decode_token": self.chain_seam_bytes_per_decode_token,
            "hop_decode_rtt_s": self.hop_decode_rtt_s,
            "driver_cpu_s": self.driver_cpu_s,
            "sessions": [asdict(s) for s in self.sessions],
            "workers": [w.to_json() for w in self.workers],
        }


def _metric_map(resp: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in resp.samples:
        if s.name.endswith("_bucket"):
            continue
        out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class _Sampler:
    """Polls GetMetrics on every worker while sessions run (peak KV, sessions, RSS)."""

    def __init__(self, driver: Any, stats: list[WorkerStats], pids: list[int], period: float = 0.1) -> None:
        self.driver, self.stats, self.pids, self.period = driver, stats, pids, period
        self.before: list[dict[str, float]] = []
        self._task: asyncio.Task | None = None

    async def _poll_once(self) -> list[dict[str, float]]:
        from dgr.shard.v1 import shard_runtime_pb2 as pb

        maps = []
        for sh, st, pid in zip(self.driver.shards, self.stats, self.pids):
            try:
                r = await sh.stub.GetMetrics(pb.GetMetricsRequest(), timeout=5)
            except Exception:
                maps.append({})
                continue
            st.kv_cells_total = r.load.kv_cells_total
            st.kv_cells_peak = max(st.kv_cells_peak, r.load.kv_cells_used)
            st.active_sessions_peak = max(st.active_sessions_peak, r.load.active_sessions)
            st.sessions_left, st.kv_cells_left = r.load.active_sessions, r.load.kv_cells_used
            rss = _rss(pid)
            st.rss_bytes = rss or st.rss_bytes
            st.rss_peak_bytes = max(st.rss_peak_bytes, rss)
            maps.append(_metric_map(r))
        return maps

    async def start(self) -> None:
        self.before = await self._poll_once()

        async def loop() -> None:
            while True:
                await asyncio.sleep(self.period)
                await self._poll_once()
        self._task = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        # sessions release asynchronously on the workers: give them a moment, bounded
        end = time.monotonic() + 5
        after = await self._poll_once()
        while any(st.sessions_left for st in self.stats) and time.monotonic() < end:
            await asyncio.sleep(0.05)
            after = await self._poll_once()
        for st, b, a in zip(self.stats, self.before, after):
            d = lambda k: a.get(k, 0.0) - b.get(k, 0.0)  # noqa: E731
            st.steps = int(d("dgr_steps_total"))
            st.batches = int(d("dgr_batches_total"))
            st.batch_rows = int(d("dgr_batch_rows_total"))
            st.queue_wait_s, st.queue_waits = d("dgr_queue_wait_seconds_sum"), int(d("dgr_queue_wait_seconds_count"))
            st.step_latency_s, st.step_count = d("dgr_step_latency_seconds_sum"), int(d("dgr_step_latency_seconds_count"))


CHAIN_BYTES = "dgr_chain_frame_bytes_sent_total"
CHAIN_FRAMES = "dgr_chain_frames_sent_total"


async def chain_counters(driver: Any, phase: str = "decode") -> list[tuple[float, float]]:
    """Per non-tail shard of the route: (serialized frame bytes, frames) it has sent downstream
    for ``phase`` (worker counters; chained mode)."""
    from dgr.shard.v1 import shard_runtime_pb2 as pb

    out = []
    for sh in driver.shards[:-1]:
        nbytes = frames = 0.0
        try:
            r = await sh.stub.GetMetrics(pb.GetMetricsRequest(), timeout=5)
        except Exception:
            out.append((0.0, 0.0))
            continue
        for m in r.samples:
            if m.labels.get("phase") != phase:
                continue
            if m.name == CHAIN_BYTES:
                nbytes += m.value
            elif m.name == CHAIN_FRAMES:
                frames += m.value
        out.append((nbytes, frames))
    return out


def chain_seam_bytes(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]) -> list[float]:
    """Bytes per frame per seam between two :func:`chain_counters` readings (0: no frames)."""
    return [(a[0] - b[0]) / (a[1] - b[1]) if a[1] > b[1] else 0.0 for b, a in zip(before, after)]


CHAIN_HOP_SECONDS = "dgr_chain_hop_seconds_total"
CHAIN_REPLIES = "dgr_chain_replies_total"


async def chain_hop_counters(driver: Any, phase: str = "decode") -> list[tuple[float, float]]:
    """Per non-tail shard of the route: (seconds its forwarded frames waited for the answer, answers)
    for ``phase``: each worker measures its own downstream hop (chained mode)."""
    from dgr.shard.v1 import shard_runtime_pb2 as pb

    out = []
    for sh in driver.shards[:-1]:
        secs = n = 0.0
        try:
            r = await sh.stub.GetMetrics(pb.GetMetricsRequest(), timeout=5)
        except Exception:
            out.append((0.0, 0.0))
            continue
        for m in r.samples:
            if m.labels.get("phase") != phase:
                continue
            if m.name == CHAIN_HOP_SECONDS:
                secs += m.value
            elif m.name == CHAIN_REPLIES:
                n += m.value
        out.append((secs, n))
    return out


def chain_hop_rtt(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]) -> list[float]:
    """Mean round trip per forwarded frame per hop between two :func:`chain_hop_counters`
    readings (0: no frames, or a worker without the counter)."""
    return chain_seam_bytes(before, after)


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def _is_chatml(driver: Any) -> bool:
    try:
        return len(await driver.tokenize("<|im_start|>", add_special=False, parse_special=True)) == 1
    except Exception:
        return False


async def prompt_tokens(driver: Any, prompts: Sequence[str], *, chat: bool) -> list[list[int]]:
    use_chat = chat and await _is_chatml(driver)
    out = []
    for p in prompts:
        text = CHATML.format(prompt=p) if use_chat else p
        out.append(await driver.tokenize(text, add_special=True, parse_special=use_chat))
    return out


async def run_sessions(endpoints: Sequence[str], prompts: Sequence[str], *, label: str = "route",
                       max_tokens: int = 32, sampling: Any = None, chat: bool = True,
                       stop_on_eog: bool = True, stats: list[WorkerStats] | None = None,
                       pids: Sequence[int] = (), on_text: Callable[[int, str], None] | None = None,
                       stream_period: float = 0.2, timeout: float = 60.0,
                       token_prompts: Sequence[Sequence[int]] | None = None,
                       chain: bool | None = None, tokens_per_answer: int | None = None) -> RunReport:
    """Runs one Route Session per prompt, all concurrently; streams text through ``on_text``
    (session index, new text) and returns per-session and per-worker figures. ``chain``: the
    driver's mode (None: chained when the workers support it, False: stepwise, True: chained
    or fail). ``tokens_per_answer``: chained mode, tokens per answer from the head (None: the
    driver's default; 1: every token is timed as it is made)."""
    from meshnet_adapter.route_driver import RouteDriver, Sampling

    kw = {"tokens_per_answer": tokens_per_answer} if tokens_per_answer else {}
    driver = await RouteDriver(list(endpoints), timeout=timeout, chain=chain, **kw).connect()
    try:
        toks = [list(t) for t in token_prompts] if token_prompts is not None else \
            await prompt_tokens(driver, prompts, chat=chat)
        stats = stats if stats is not None else []
        sampler = _Sampler(driver, stats, list(pids)) if stats else None
        if sampler:
            await sampler.start()
        got: list[list[int]] = [[] for _ in toks]
        shown = [""] * len(toks)
        done = asyncio.Event()

        async def streamer() -> None:
            while True:
                try:
                    await asyncio.wait_for(done.wait(), stream_period)
                except asyncio.TimeoutError:
                    pass
                for i, g in enumerate(got):
                    if len(g) and on_text is not None:
                        text = (await driver.detokenize(g)).decode("utf-8", errors="ignore")
                        if text != shown[i] and text.startswith(shown[i]):
                            on_text(i, text[len(shown[i]):])
                            shown[i] = text
                if done.is_set():
                    return

        stream_task = asyncio.create_task(streamer()) if on_text is not None else None
        chained = driver.chained and len(driver.shards) > 1
        seam0 = await chain_counters(driver) if chained else []
        hops0 = await chain_hop_counters(driver) if chained else []
        t0 = time.perf_counter()
        c0 = time.process_time()

        times: list[list[float]] = [[] for _ in toks]

        def on_token(i: int, tok: int) -> None:
            times[i].append(time.perf_counter() - t0)
            got[i].append(tok)

        async def one(i: int, p: list[int]) -> Any:
            return await driver.generate(p, max_tokens=max_tokens, sampling=sampling or Sampling(),
                                         stop_on_eog=stop_on_eog, on_token=lambda tok: on_token(i, tok))

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(toks)))
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        done.set()
        if stream_task:
            await stream_task
        if sampler:
            await sampler.stop()
        chain_seam = chain_seam_bytes(seam0, await chain_counters(driver)) if chained else []
        # chained: the driver times its hop to the head, each worker times its hop downstream
        chain_hops = chain_hop_rtt(hops0, await chain_hop_counters(driver)) if chained else []
        reports = []
        for i, r in enumerate(results):
            tel = r.telemetry
            text = (await driver.detokenize(r.tokens)).decode("utf-8", errors="replace") if r.tokens else ""
            # absolute decode window: sessions start together at t0 (+ tokenization, negligible)
            start = tel.ttft_s
            reports.append(SessionReport(
                index=i, prompt=prompts[i] if i < len(prompts) else "", prompt_tokens=len(toks[i]),
                tokens=list(r.tokens), text=text, finish_reason=r.finish_reason, status=tel.status,
                error=str(r.error) if r.error else None, ttft_s=tel.ttft_s, prefill_tok_s=tel.prefill_tok_s,
                decode_tok_s=tel.decode_tok_s, decode_start_s=start, decode_end_s=start + tel.decode_s,
                seam_bytes_per_decode_token=(list(chain_seam) if chained else
                                             [n.decode_frame_bytes_per_token for n in tel.nodes[1:]]),
                hop_decode_rtt_s=([tel.nodes[0].decode_step_s, *chain_hops] if chained else
                                  [n.decode_step_s for n in tel.nodes]), telemetry=tel.to_json(),
                top_logprobs=[list(x) for x in r.top_logprobs], token_times_s=times[i]))
        return RunReport(label, [f"{s.endpoint}[{s.start}:{s.end})" for s in driver.shards], reports, wall,
                         stats, cpu, mode=driver.mode, chain_seam_bytes_per_decode_token=chain_seam)
    finally:
        await driver.close()


# ---- parity ----------------------------------------------------------------------------
#
# Exact parity is checked one session at a time: with an f32 boundary on one backend a split run
# is bit-identical to the whole model (docs/patches.md). Sessions that run *concurrently* share
# llama.cpp batches, and a different batch composition changes the summation order (and the
# q8 rounding of activations), so their logits move by noise (up to ~0.3 nats seen on SmolLM2
# Q4_1) and a greedy choice can flip where two tokens are nearly tied. Isolation of concurrent
# sessions is therefore checked against each session's own sequential run: identical up to the
# first divergence, which must be a near-tie, with small logprob noise before it. Cross-session
# corruption (another session's KV or rows) breaks both bounds immediately.

NEAR_TIE_NATS = 0.25      # top-1 vs top-2 gap at a tolerated divergence
NOISE_NATS = 1.0          # largest top-1 logprob difference tolerated before it


@dataclass
class Parity:
    sessions: int
    matched_sessions: int
    compared_tokens: int
    agreeing_tokens: int
    first_divergence: list[int | None]
    max_logprob_diff: float = 0.0

    @property
    def ok(self) -> bool:
        return self.sessions == self.matched_sessions

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _first_div(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    k = next((i for i in range(n) if a[i] != b[i]), None)
    return n if k is None and len(a) != len(b) else k


def compare(route: RunReport, whole: RunReport) -> Parity:
    """Exact token (and, when recorded, top logprob) agreement, session by session."""
    matched, cmp_, agree, first, lp = 0, 0, 0, [], 0.0
    for r, w in zip(route.sessions, whole.sessions):
        n = min(len(r.tokens), len(w.tokens))
        cmp_ += n
        agree += sum(x == y for x, y in zip(r.tokens[:n], w.tokens[:n]))
        div = _first_div(r.tokens, w.tokens)
        first.append(div)
        for ra, wa in zip(r.top_logprobs, w.top_logprobs):
            for x, y in zip(ra, wa):
                lp = max(lp, abs(x[1] - y[1]) if x[0] == y[0] else float("inf"))
        matched += div is None and r.error is None and w.error is None
    return Parity(len(route.sessions), matched, cmp_, agree, first, lp)


@dataclass
class Isolation:
    sessions: int
    identical: int
    near_tie_divergences: int
    violations: list[str]
    max_noise_nats: float

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def isolation(concurrent: RunReport, sequential: RunReport, *, near_tie: float = NEAR_TIE_NATS,
              noise: float = NOISE_NATS) -> Isolation:
    """Concurrent sessions vs the same sessions run one at a time (needs top_logprobs, 5 here)."""
    ident = ties = 0
    bad: list[str] = []
    worst = 0.0
    for c, s in zip(concurrent.sessions, sequential.sessions):
        if c.error or s.error:
            bad.append(f"session {c.index}: {c.error or s.error}")
            continue
        k = _first_div(c.tokens, s.tokens)
        n = len(c.tokens) if k is None else k
        for ct, st in zip(c.top_logprobs[:n], s.top_logprobs[:n]):
            worst = max(worst, abs(ct[0][1] - st[0][1]))
        if k is None:
            ident += 1
            continue
        if k >= min(len(c.tokens), len(s.tokens)):
            bad.append(f"session {c.index}: lengths differ ({len(c.tokens)} vs {len(s.tokens)}) without divergence")
            continue
        st = dict(s.top_logprobs[k]) if k < len(s.top_logprobs) else {}
        c_tok = c.tokens[k]
        gap = (st[s.tokens[k]] - st[c_tok]) if c_tok in st and s.tokens[k] in st else float("inf")
        if gap > near_tie:
            bad.append(f"session {c.index}: diverges at token {k} where the sequential run was not near a tie "
                       f"(token {c_tok} is {gap:.3f} nats below the sequential choice)")
        else:
            ties += 1
    if worst > noise:
        bad.append(f"logprob noise before divergence {worst:.3f} nats > {noise}")
    return Isolation(len(concurrent.sessions), ident, ties, bad, worst)


# ---- one call for CLI commands -------------------------------------------------------------

@dataclass
class RouteRun:
    route: RunReport                     # the sessions, concurrently, through the route
    whole: RunReport | None              # the same, concurrently, on one whole-model worker
    parity: Parity | None                # route vs whole, one session at a time: exact
    split: list[tuple[int, int]]
    model: str
    isolation: Isolation | None = None   # concurrent route sessions vs their sequential runs
    route_sequential: RunReport | None = None
    whole_sequential: RunReport | None = None
    # stock whole-model llama.cpp (llama-batched-bench at the pin), measured after the runs above
    llama: WholeLlama | None = None
    llama_error: str | None = None       # why it was asked for but not measured

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "split": [f"{a}:{b}" for a, b in self.split],
                "route": self.route.to_json(), "whole": self.whole.to_json() if self.whole else None,
                "parity": self.parity.to_json() if self.parity else None,
                "isolation": self.isolation.to_json() if self.isolation else None,
                "route_sequential": self.route_sequential.to_json() if self.route_sequential else None,
                "whole_sequential": self.whole_sequential.to_json() if self.whole_sequential else None,
                "llama": self.llama.to_json() if self.llama else None, "llama_error": self.llama_error}


def whole_llama_baseline(model: Path | None, *, threads: int, n_prompt: int, n_gen: int,
                         sessions: tuple[int, ...], log: Callable[[str], None] | None = None,
                         backend: str = "cpu") -> tuple[WholeLlama | None, str | None]:
    """Stock whole-model llama.cpp figures (:func:`dgr.llama_whole.measure_whole_llama`), or
    ``(None, reason)`` when they cannot be had (no GGUF, tool missing and not buildable, the
    tool failed): a yardstick, never a reason for the caller to fail."""
    from . import llama_whole

    log = log or (lambda _m: None)
    if model is None:
        return None, "no GGUF model (fake-model workers)"
    log(f"whole-model llama.cpp: llama-batched-bench -npp {n_prompt} -ntg {n_gen} "
        f"-npl {','.join(str(b) for b in sorted(set(sessions)))} -t {threads} (stock llama.cpp at the pin, ~10-20 s)")
    try:
        res = llama_whole.measure_whole_llama(model, threads=threads, n_prompt=n_prompt, n_gen=n_gen,
                                              sessions=sessions, backend=backend)
    except Exception as exc:  # noqa: BLE001 - a failed yardstick is reported, not raised
        reason = (exc.one_line() if isinstance(exc, DgrError) else str(exc)) or type(exc).__name__
        log(f"llama.cpp baseline not measured: {reason}")
        return None, reason
    if not res.rows:
        reason = "llama-batched-bench printed no result rows"
        log(f"llama.cpp baseline not measured: {reason}")
        return None, reason
    return res, None


async def _sequential(endpoints: Sequence[str], prompts: Sequence[str], label: str, **kw: Any) -> RunReport:
    """Each prompt alone (one session at a time); one combined report."""
    reps = [await run_sessions(endpoints, [p], label=label, **kw) for p in prompts]
    out = RunReport(label, reps[0].route, [], sum(r.wall_s for r in reps), mode=reps[0].mode)
    for i, r in enumerate(reps):
        r.sessions[0].index = i
        out.sessions.append(r.sessions[0])
    return out


def run_local(model: Path | None, split: Sequence[tuple[int, int]], prompts: Sequence[str], *,
              max_tokens: int = 32, sampling: Any = None, parity: bool = False, fake: bool = False,
              slices: bool = False, threads: int | None = None, chat: bool = True,
              stop_on_eog: bool = True, on_text: Callable[[int, str], None] | None = None,
              log: Callable[[str], None] | None = None, chain: bool | None = None,
              llama_baseline: bool = False) -> RouteRun:
    """Start local workers for ``split`` and run the prompts concurrently. With ``parity``
    (greedy): also run each prompt alone on the route and on one whole-model worker (exact
    parity), check the concurrent sessions' isolation against their sequential runs, and run
    the prompts concurrently on the whole-model worker for the same figures. With
    ``llama_baseline``: afterwards (every worker stopped) measure stock whole-model llama.cpp
    (llama-batched-bench) at the mean prompt length, ``max_tokens``, 1 and len(prompts)
    sessions and the workers' thread count; a failure is recorded in ``llama_error``."""
    from meshnet_adapter.route_driver import Sampling

    log = log or (lambda _m: None)
    threads = threads or os.cpu_count() or 1
    n_layer = split[-1][1]
    max_sessions = max(4, len(prompts))
    greedy = sampling is None or getattr(sampling, "temperature", 0) <= 0
    if parity and greedy:
        sampling = Sampling(top_logprobs=5, ignore_eog=getattr(sampling, "ignore_eog", False))
    kw = dict(max_tokens=max_tokens, sampling=sampling, chat=chat, stop_on_eog=stop_on_eog, chain=chain)
    label = f"route {','.join(f'{a}:{b}' for a, b in split)}"
    seq = wseq = whole = par = iso = None
    with LocalRoute(model, split, fake=fake, slices=slices, threads=threads, max_sessions=max_sessions,
                    log=log) as lr:
        rep = asyncio.run(run_sessions(lr.endpoints, prompts, label=label, stats=lr.stats(),
                                       pids=[w.pid for w in lr.workers], on_text=on_text, **kw))
        if parity:
            log("the same prompts one at a time through the route")
            seq = asyncio.run(_sequential(lr.endpoints, prompts, label + " (sequential)", **kw))
    if parity:
        log(f"whole model [0:{n_layer}) on one worker")
        with LocalRoute(model, [(0, n_layer)], fake=fake, threads=threads, max_sessions=max_sessions, log=log) as lw:
            whole = asyncio.run(run_sessions(lw.endpoints, prompts, label=f"whole model 0:{n_layer}",
                                             stats=lw.stats(), pids=[w.pid for w in lw.workers], **kw))
            wseq = asyncio.run(_sequential(lw.endpoints, prompts, f"whole model 0:{n_layer} (sequential)", **kw))
        if greedy:
            par = compare(seq, wseq)
            iso = isolation(rep, seq)
    llama = llama_err = None
    if llama_baseline:  # after the route and whole-worker runs: never competes with them for cores
        n_prompt = round(sum(s.prompt_tokens for s in rep.sessions) / max(1, len(rep.sessions)))
        llama, llama_err = whole_llama_baseline(None if fake else model, threads=threads, n_prompt=n_prompt,
                                                n_gen=max_tokens, sessions=(1, len(prompts)), log=log)
    return RouteRun(rep, whole, par, list(split), str(model) if model else "fake", iso, seq, wseq,
                    llama=llama, llama_error=llama_err)


def generate_remote(endpoints: Sequence[str], prompts: Sequence[str], *, max_tokens: int = 32,
                    sampling: Any = None, chat: bool = True, stop_on_eog: bool = True,
                    on_text: Callable[[int, str], None] | None = None,
                    chain: bool | None = None) -> RunReport:
    """Sessions against already running workers (``dgr route generate --shard …``)."""
    from meshnet_adapter.route_driver import RouteError

    try:
        return asyncio.run(run_sessions(endpoints, prompts, max_tokens=max_tokens, sampling=sampling, chat=chat,
                                        stop_on_eog=stop_on_eog, on_text=on_text, chain=chain))
    except RouteError:
        raise


# ---- presentation (plain text; the commands print it) --------------------------------------

def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


WHOLE_WORKER = "whole model on 1 dgr-worker"
LLAMA_BENCH = "llama.cpp (llama-batched-bench)"
TABLE_WIDTH = 100


def _llama_note(run: RouteRun) -> list[str]:
    """The footnote under the llama.cpp rows, or the line saying why there are none."""
    import textwrap

    if run.llama is not None:
        args = dict(zip(run.llama.command, run.llama.command[1:]))
        text = (f"llama.cpp rows: stock llama-batched-bench at the pin, whole model, -t {args.get('-t', '?')}, "
                f"{args.get('-npp', '?')}-token prompts (the route's mean prompt length), {args.get('-ntg', '?')} "
                f"tokens generated. It decodes the B sequences in lockstep from equal-length prompts of "
                f"synthetic tokens, so its figures are the yardstick, not a run of the same prompts.")
    elif run.llama_error is not None:
        reason = " ".join(run.llama_error.split())
        text = f"llama.cpp baseline: not measured ({reason[:297] + '...' if len(reason) > 300 else reason})"
    else:
        return []
    return textwrap.wrap(text, TABLE_WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def summary_table(run: RouteRun) -> str:
    rows = [("", "TTFT ms", "prefill tok/s", "decode tok/s")]
    for s in run.route.sessions:
        rows.append((f"route  session {s.index}", f"{s.ttft_s * 1e3:.0f}", f"{s.prefill_tok_s:.0f}",
                     f"{s.decode_tok_s:.1f}" if s.error is None else "FAILED"))
    rows.append(("route  aggregate", f"{run.route.mean_ttft_s * 1e3:.0f}", f"{run.route.aggregate_prefill_tok_s:.0f}",
                 f"{run.route.aggregate_decode_tok_s:.1f}"))
    if run.whole:
        for s in run.whole.sessions:
            rows.append((f"{WHOLE_WORKER}  session {s.index}", f"{s.ttft_s * 1e3:.0f}", f"{s.prefill_tok_s:.0f}",
                         f"{s.decode_tok_s:.1f}" if s.error is None else "FAILED"))
        rows.append((f"{WHOLE_WORKER}  aggregate", f"{run.whole.mean_ttft_s * 1e3:.0f}",
                     f"{run.whole.aggregate_prefill_tok_s:.0f}", f"{run.whole.aggregate_decode_tok_s:.1f}"))
    if run.llama:
        for r in run.llama.rows:
            if r.sessions == 1:
                rows.append((f"{LLAMA_BENCH} 1 session", f"{r.ttft_s * 1e3:.0f}", f"{r.prefill_tok_s:.0f}",
                             f"{r.decode_tok_s:.1f}"))
                continue
            # each of the B sequences: the prompt phase holds all B prompts, so per-session
            # prefill is the aggregate / B (comparable to the route's "session i" rows)
            rows.append((f"{LLAMA_BENCH} per session ({r.sessions})", f"{r.ttft_s * 1e3:.0f}",
                         f"{r.prefill_tok_s / r.sessions:.0f}", f"{r.per_session_decode_tok_s:.1f}"))
            rows.append((f"{LLAMA_BENCH} aggregate ({r.sessions})", f"{r.ttft_s * 1e3:.0f}",
                         f"{r.prefill_tok_s:.0f}", f"{r.decode_tok_s:.1f}"))
    w0 = max(len(r[0]) for r in rows)
    lines = ["  ".join([r[0].ljust(w0), *(c.rjust(13) for c in r[1:])]) for r in rows]
    lines += _llama_note(run)
    lines.append("")
    lines.append(f"seam bytes per decode token (per seam, protobuf frame): {run.route.seam_bytes_per_decode_token:.0f}"
                 f" ({run.route.mode} route)")
    hops = run.route.hop_decode_rtt_s
    if hops:
        who = "driver -> head, then each worker -> its next shard" if run.route.mode == "chained" else "driver -> each shard"
        lines.append("decode round trip per hop, ms (" + who + "): " + ", ".join(f"{h * 1e3:.2f}" for h in hops))
    wrows = [("worker", "RSS", "KV peak", "KV cells peak/total", "mean batch rows", "mean queue ms")]
    for label, rep in (("route", run.route), ("whole 1 dgr-worker", run.whole)):
        if rep is None:
            continue
        for w in rep.workers:
            wrows.append((f"{label} [{w.range})", _mb(w.rss_peak_bytes), _mb(w.kv_peak_bytes),
                          f"{w.kv_cells_peak}/{w.kv_cells_total}", f"{w.mean_batch_rows:.2f}",
                          f"{w.mean_queue_wait_s * 1e3:.2f}"))
    if run.llama and run.llama.rows:
        # peak RSS of the llama-batched-bench process; KV its sequences held at the largest B
        top = max(run.llama.rows, key=lambda r: r.sessions)
        wrows.append((f"llama-batched-bench ({top.sessions})", _mb(run.llama.peak_rss_bytes), _mb(top.kv_bytes),
                      "-", "-", "-"))
    widths = [max(len(r[k]) for r in wrows) for k in range(len(wrows[0]))]
    lines += ["  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:]))]) for r in wrows]
    if run.parity:
        p = run.parity
        lines.append("")
        lines.append(f"greedy parity vs whole model: {'OK' if p.ok else 'MISMATCH'} — {p.matched_sessions}/{p.sessions} "
                     f"sessions identical one at a time, {p.agreeing_tokens}/{p.compared_tokens} tokens agree, "
                     f"max |d logprob| {p.max_logprob_diff:.3g}")
    if run.isolation:
        i = run.isolation
        lines.append(f"concurrent isolation: {'OK' if i.ok else 'FAILED'} — {i.identical}/{i.sessions} sessions identical "
                     f"to their sequential runs, {i.near_tie_divergences} diverge at a near-tie (batched numerics, "
                     f"noise <= {i.max_noise_nats:.2f} nats)" + ("; " + "; ".join(i.violations) if i.violations else ""))
    return "\n".join(lines)


def ensure_worker(backend: str = "cpu", log: Callable[[str], None] | None = None) -> Path:
    """The dgr-worker binary, built first when missing (patched llama.cpp + worker)."""
    from . import build as build_mod

    try:
        return build_mod.worker_binary(backend)
    except DgrError:
        (log or (lambda _m: None))(f"dgr-worker is not built yet: building it for {backend} (one-time, minutes)")
        build_mod.build(backend)
        return build_mod.worker_binary(backend)
