"""Run Route Sessions: one per prompt, all concurrently, through
:class:`dgr.route.driver.RouteDriver`; stream text; collect per-session figures (TTFT, prefill
and decode rates, seam bytes, token times) and per-worker figures polled from GetMetrics (peak
KV, sessions, RSS, batch rows, queue waits).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from ..errors import DgrError
from ..procfs import status_bytes
from ..protocol.errors import WorkerError
from .text import PieceCache, TextDecoder, chat_prompt_text

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "Explain what a transformer layer does, in two sentences.",
)


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
    # the device the range computes on (GetCapability.device): its class, and the memory
    # admission predicted the range needs on it (weights offloaded, KV, compute; 0 on the CPU,
    # whose use is the RSS above) out of the device's total
    device_class: str = ""
    device_memory_bytes: int = 0
    device_memory_total_bytes: int = 0

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
    routes: list[list[str]] = field(default_factory=list)   # with standbys: every route used, in order
    work: dict[str, Any] | None = None   # with standbys: the work records summed (work_records.summarize)

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
            **({"routes": self.routes, "work": self.work} if self.work is not None else {}),
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
        maps = []
        for sh, st, pid in zip(self.driver.shards, self.stats, self.pids):
            try:
                r = await sh.client.metrics(timeout=5)
            except WorkerError:
                maps.append({})
                continue
            st.kv_cells_total = r.load.kv_cells_total
            st.kv_cells_peak = max(st.kv_cells_peak, r.load.kv_cells_used)
            st.active_sessions_peak = max(st.active_sessions_peak, r.load.active_sessions)
            st.sessions_left, st.kv_cells_left = r.load.active_sessions, r.load.kv_cells_used
            rss = status_bytes(pid, "VmRSS")
            st.rss_bytes = rss or st.rss_bytes
            st.rss_peak_bytes = max(st.rss_peak_bytes, rss)
            maps.append(_metric_map(r))
        return maps

    async def start(self) -> None:
        for sh, st in zip(self.driver.shards, self.stats):
            dev = sh.capability.device
            st.device_class = dev.device_class or ("cpu" if sh.capability.runtime.backend == "cpu" else "")
            st.device_memory_bytes = int(dev.memory_predicted_bytes)
            st.device_memory_total_bytes = int(dev.memory_total_bytes)
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


async def _chain_counter_pairs(driver: Any, phase: str, total: str, count: str) -> list[tuple[float, float]]:
    """Per non-tail shard of the route: the sums of the ``total`` and ``count`` worker metrics
    labelled ``phase`` ((0, 0) for a shard that does not answer)."""
    out = []
    for sh in driver.shards[:-1]:
        tot = n = 0.0
        try:
            r = await sh.client.metrics(timeout=5)
        except WorkerError:
            out.append((0.0, 0.0))
            continue
        for m in r.samples:
            if m.labels.get("phase") != phase:
                continue
            if m.name == total:
                tot += m.value
            elif m.name == count:
                n += m.value
        out.append((tot, n))
    return out


async def chain_counters(driver: Any, phase: str = "decode") -> list[tuple[float, float]]:
    """Per non-tail shard of the route: (serialized frame bytes, frames) it has sent downstream
    for ``phase`` (worker counters; chained mode)."""
    return await _chain_counter_pairs(driver, phase, CHAIN_BYTES, CHAIN_FRAMES)


def chain_seam_bytes(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]) -> list[float]:
    """Bytes per frame per seam between two :func:`chain_counters` readings (0: no frames)."""
    return [(a[0] - b[0]) / (a[1] - b[1]) if a[1] > b[1] else 0.0 for b, a in zip(before, after)]


CHAIN_HOP_SECONDS = "dgr_chain_hop_seconds_total"
CHAIN_REPLIES = "dgr_chain_replies_total"


async def chain_hop_counters(driver: Any, phase: str = "decode") -> list[tuple[float, float]]:
    """Per non-tail shard of the route: (seconds its forwarded frames waited for the answer, answers)
    for ``phase``: each worker measures its own downstream hop (chained mode)."""
    return await _chain_counter_pairs(driver, phase, CHAIN_HOP_SECONDS, CHAIN_REPLIES)


def chain_hop_rtt(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]) -> list[float]:
    """Mean round trip per forwarded frame per hop between two :func:`chain_hop_counters`
    readings (0: no frames, or a worker without the counter)."""
    return chain_seam_bytes(before, after)


async def prompt_tokens(driver: Any, prompts: Sequence[str], *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt; with ``chat``, as one user message formatted by the model's own
    chat template (the head's ApplyChatTemplate). A model without a usable template gets the
    prompt as is."""
    import grpc

    out = []
    for p in prompts:
        text, special = p, False
        if chat:
            try:
                text, special = await chat_prompt_text(driver.head.client, [("user", p)], timeout=driver.timeout), True
            except WorkerError as exc:
                if exc.code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED):
                    raise
                chat = False   # no template (or an older worker): every prompt as is
        out.append(await driver.tokenize(text, add_special=True, parse_special=special))
    return out


async def run_sessions(endpoints: Sequence[str], prompts: Sequence[str], *, label: str = "route",
                       max_tokens: int = 32, sampling: Any = None, chat: bool = True,
                       stop_on_eog: bool = True, stats: list[WorkerStats] | None = None,
                       pids: Sequence[int] = (), on_text: Callable[[int, str], None] | None = None,
                       stream_period: float = 0.2, timeout: float = 60.0,
                       token_prompts: Sequence[Sequence[int]] | None = None,
                       chain: bool | None = None, tokens_per_answer: int | None = None,
                       tls: Any = None, standby: Sequence[str] = (), max_restarts: int = 2,
                       hops: Sequence[str] | None = None) -> RunReport:
    """Runs one Route Session per prompt, all concurrently; streams text through ``on_text``
    (session index, new text) and returns per-session and per-worker figures. ``chain``: the
    driver's mode (None: chained when the workers support it, False: stepwise, True: chained
    or fail). ``tokens_per_answer``: chained mode, tokens per answer from the head (None: the
    driver's default; 1: every token is timed as it is made). ``tls``: a
    :class:`dgr.protocol.tls.TlsFiles` for mutual TLS to every shard. ``standby``: further
    workers; with them a session whose shard fails restarts from token zero on a route that uses
    a standby (:mod:`dgr.route.failover`) and its work record comes with its telemetry. ``hops``:
    what each shard's predecessor dials in the chained mode (``RouteDriver``'s ``hops``: relay
    egresses of a relayed route; not with ``standby``, whose new routes have none)."""
    from .driver import RouteDriver, Sampling

    kw = {"tokens_per_answer": tokens_per_answer} if tokens_per_answer else {}
    router = None
    if standby and hops:
        raise DgrError("a relayed route's hops do not go with standby workers")
    if standby:
        from .failover import FailoverRouter

        router = await FailoverRouter(list(endpoints), max_restarts=max_restarts, timeout=timeout, chain=chain,
                                      tls=tls, **kw).connect()
        router.finder.endpoints += [e for e in standby if e not in router.finder.endpoints]
        driver = router.route
    else:
        driver = await RouteDriver(list(endpoints), timeout=timeout, chain=chain, tls=tls, hops=hops, **kw).connect()
    try:
        toks = [list(t) for t in token_prompts] if token_prompts is not None else \
            await prompt_tokens(driver, prompts, chat=chat)
        stats = stats if stats is not None else []
        sampler = _Sampler(driver, stats, list(pids)) if stats else None
        if sampler:
            await sampler.start()
        got: list[list[int]] = [[] for _ in toks]
        sent = [0] * len(toks)                     # tokens already turned into text
        decoders = [TextDecoder() for _ in toks]
        pieces = PieceCache(driver.head.client, timeout=driver.timeout)
        done = asyncio.Event()

        async def streamer() -> None:
            """Every ``stream_period``: the new tokens' pieces (each id looked up once), decoded
            incrementally per session."""
            while True:
                try:
                    await asyncio.wait_for(done.wait(), stream_period)
                except asyncio.TimeoutError:
                    pass
                for i, g in enumerate(got):
                    new = g[sent[i]:]
                    if (new or done.is_set()) and on_text is not None:
                        sent[i] += len(new)
                        data = b"".join(await pieces.pieces(new)) if new else b""
                        text = decoders[i].push(data, final=done.is_set())
                        if text:
                            on_text(i, text)
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
            if router is not None:
                f = await router.generate(p, max_tokens=max_tokens, sampling=sampling or Sampling(),
                                          stop_on_eog=stop_on_eog, on_token=lambda tok: on_token(i, tok))
                last = f.results[-1]      # the last attempt's telemetry carries the work record
                return type(last)(f.session_id, f.prompt_tokens, f.tokens, f.finish_reason, last.telemetry,
                                  error=f.error, top_logprobs=[])
            return await driver.generate(p, max_tokens=max_tokens, sampling=sampling or Sampling(),
                                         stop_on_eog=stop_on_eog, on_token=lambda tok: on_token(i, tok))

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(toks)))
        wall = time.perf_counter() - t0
        if router is not None and router.route is not driver:
            chained = False       # the route changed: the seam counters of the first route do not apply
            driver = router.route
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
        rep = RunReport(label, [f"{s.endpoint}[{s.start}:{s.end})" for s in driver.shards], reports, wall,
                        stats, cpu, mode=driver.mode, chain_seam_bytes_per_decode_token=chain_seam)
        if router is not None:
            from .work_records import summarize
            rep.routes = router.routes
            rep.work = summarize([_work(r.telemetry.work) for r in results if r.telemetry.work])
        return rep
    finally:
        if router is not None:
            await router.close()
        else:
            await driver.close()


def _work(d: dict[str, Any]) -> Any:
    from .work_records import AttemptRecord, SessionWorkRecord, ShardWork

    atts = [AttemptRecord(**{**a, "shards": [ShardWork(**x) for x in a["shards"]]}) for a in d["attempts"]]
    return SessionWorkRecord(**{**d, "attempts": atts})
