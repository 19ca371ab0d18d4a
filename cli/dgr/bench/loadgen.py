"""An OpenAI-API load generator and a llama-server process, shared by ``dgr bench serve`` and
``dgr demo`` (whose llama.cpp rows come from llama-server serving the same prompts).

:func:`run_level` sends N streaming chat requests at once (``httpx``, the OpenAI API's JSON and
server-sent events) and records, per request, the time to its first content chunk, each
chunk's arrival and the token counts the server reports (``stream_options.include_usage``). :class:`LevelResult`
derives the figures every lane reports the same way, the cadence of the text (chunks per token,
inter-token latency) among them.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from dgr import childproc
from dgr.errors import DgrError
from dgr.procfs import status_bytes

START_TIMEOUT_S = 120.0


@dataclass
class RequestResult:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float                  # request sent (its body about to be written) -> first content
    first_s: float                 # first content, since the level started
    last_s: float                  # last content, since the level started
    text: str = ""
    error: str | None = None
    route_ttft_s: float | None = None   # dgr serve: the route's share of the TTFT (its stream's "server_timing")
    send_s: float = 0.0                 # from this request's turn in the client to its body's write
    chunk_times_s: list[float] = field(default_factory=list)   # each event that carried text, since the level started


@dataclass
class LevelResult:
    lane: str
    concurrency: int
    requests: list[RequestResult]
    wall_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)   # process name -> CPU seconds in this level

    @property
    def gateway_ttft_mean_s(self) -> float | None:
        """dgr serve lanes: the mean route share of the TTFT the gateway reported, else None."""
        inner = [r.route_ttft_s for r in self.requests if r.error is None and r.route_ttft_s is not None]
        return statistics.mean(inner) if inner else None

    @property
    def ok(self) -> bool:
        return bool(self.requests) and all(r.error is None for r in self.requests)

    @property
    def aggregate_decode_tok_s(self) -> float:
        """Tokens after each request's first, over the window from the earliest first token to
        the latest last token (the route report's definition)."""
        ok = [r for r in self.requests if r.error is None]
        if not ok:
            return 0.0
        n = sum(max(0, r.completion_tokens - 1) for r in ok)
        window = max(r.last_s for r in ok) - min(r.first_s for r in ok)
        return n / window if window > 0 else 0.0

    @property
    def ttft_p50_s(self) -> float:
        ok = [r.ttft_s for r in self.requests if r.error is None]
        return statistics.median(ok) if ok else 0.0

    @property
    def cadence(self) -> dict[str, Any]:
        """Chunks per token and the inter-token latency of the level's requests (stats.cadence)."""
        from .stats import cadence

        ok = [r for r in self.requests if r.error is None]
        return cadence([r.chunk_times_s for r in ok], [r.completion_tokens for r in ok])

    def to_json(self) -> dict[str, Any]:
        return {"lane": self.lane, "concurrency": self.concurrency, "ok": self.ok, "wall_s": self.wall_s,
                "aggregate_decode_tok_s": self.aggregate_decode_tok_s, "ttft_p50_s": self.ttft_p50_s,
                "ttft_s": [r.ttft_s for r in self.requests],
                "route_ttft_s": [r.route_ttft_s for r in self.requests],
                "send_s": [r.send_s for r in self.requests],
                "prompt_tokens": [r.prompt_tokens for r in self.requests],
                "completion_tokens": [r.completion_tokens for r in self.requests],
                "errors": [r.error for r in self.requests if r.error], "cpu_s": self.cpu_s,
                "gateway_ttft_mean_s": self.gateway_ttft_mean_s, "cadence": self.cadence,
                "chunk_times_s": [r.chunk_times_s for r in self.requests]}


async def run_level(base_url: str, model: str, prompts: Sequence[str] | Sequence[Sequence[int]], *, max_tokens: int,
                    api_key: str = "none", lane: str = "", timeout: float = 600.0,
                    stop_at_eos: bool = False) -> LevelResult:
    """All ``prompts`` at once, one streaming greedy chat request each, no prompt cache (every
    server prefills afresh); unless ``stop_at_eos``, ``ignore_eos`` makes every answer
    ``max_tokens`` long. A prompt given as token ids goes as is to ``/completions`` instead (no
    chat template: the same tokens as a route driver session).

    The client is ``httpx`` speaking the OpenAI API (JSON request, server-sent events), not the
    ``openai`` package (the gateway's tests use that one): a load generator has to cost little
    next to what it measures. Measured here against ``dgr serve``: the ``openai`` client took
    1.1-1.6 ms from one request's send to the next and about 0.1 ms to parse each event (httpx
    plus ``json``: 0.016 ms); with 8 requests from one event loop, each request's body reached the
    server 9-13 ms after its headers, while the loop built the other seven, and that time was
    counted into every server's time to first token.

    A request's time to first token runs from the moment its body is about to be written
    (httpcore's ``trace`` event ``http11.send_request_body.started``; its headers are already
    out), not from its coroutine's turn: one event loop playing N users writes their requests
    one after another, and at 8 concurrent the body left 0.5-11 ms (median 3.2) after the
    request's coroutine began. That turn-taking is the load generator's, not the server's; it is
    kept per request as ``send_s``. The stamp is taken before the body's write, never after:
    ``...body.complete`` fires only once this loop resumes the request, which can be after the
    server has already started on it (seen: a route share longer than the client's TTFT)."""
    import httpx

    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(timeout=timeout, headers=headers,
                                 limits=httpx.Limits(max_connections=max(1, len(prompts)))) as client:
        # Connections are opened before the clock starts, as a long-lived client (and the route
        # driver lane, whose channels are connected before timing) would have them: one untimed
        # GET /v1/models per concurrent request warms the pool.
        try:
            await asyncio.gather(*(client.get(base_url.rstrip("/") + "/models") for _ in prompts))
        except httpx.HTTPError:   # a server without /v1/models still gets measured
            pass
        t0 = time.perf_counter()

        async def one(p: str | Sequence[int]) -> RequestResult:
            body: dict[str, Any] = {
                "model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": not stop_at_eos, "cache_prompt": False}
            if isinstance(p, str):
                url = base + "/chat/completions"
                body["messages"] = [{"role": "user", "content": p}]
            else:
                url, body["prompt"] = base + "/completions", [int(t) for t in p]
            began = time.perf_counter()
            written: list[float] = []

            async def trace(name: str, _info: Any) -> None:
                if name == "http11.send_request_body.started":
                    written.append(time.perf_counter())

            first = last = None
            chunks: list[float] = []
            usage: dict[str, Any] | None = None
            route_ttft: float | None = None
            parts: list[str] = []
            try:
                async with client.stream("POST", url, json=body, extensions={"trace": trace}) as r:
                    if r.status_code != 200:
                        text = (await r.aread()).decode("utf-8", errors="replace")
                        return RequestResult(0, 0, 0.0, 0.0, 0.0, error=f"HTTP {r.status_code}: {text[:300]}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        ch = json.loads(data)
                        if ch.get("error"):
                            return RequestResult(0, 0, 0.0, 0.0, 0.0, error=f"error event: {ch['error']}")
                        usage = ch.get("usage") or usage
                        st = ch.get("server_timing")           # dgr serve's stream: the route's share
                        ms = st.get("route_ms") if isinstance(st, dict) else None
                        if route_ttft is None and isinstance(ms, (int, float)):
                            route_ttft = ms / 1e3
                        choices = ch.get("choices") or []
                        text = ((choices[0].get("delta") or {}).get("content") or choices[0].get("text")) \
                            if choices else None
                        if text:
                            now = time.perf_counter()
                            first = first or now
                            last = now
                            chunks.append(now - t0)
                            parts.append(text)
            except (httpx.HTTPError, ValueError, AttributeError, TypeError) as exc:  # recorded per request
                # (AttributeError/TypeError: an event that is JSON but not the OpenAI shape)
                return RequestResult(0, 0, 0.0, 0.0, 0.0, error=f"{type(exc).__name__}: {exc}")
            if first is None or last is None:
                return RequestResult(0, 0, 0.0, 0.0, 0.0, error="no content streamed")
            sent = written[0] if written else began
            return RequestResult(int(usage.get("prompt_tokens", 0)) if usage else 0,
                                 int(usage.get("completion_tokens", max_tokens)) if usage else max_tokens,
                                 first - sent, first - t0, last - t0, "".join(parts), route_ttft_s=route_ttft,
                                 send_s=sent - began, chunk_times_s=chunks)

        res = await asyncio.gather(*(one(p) for p in prompts))
    return LevelResult(lane, len(prompts), list(res), time.perf_counter() - t0)


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (and its reaped children), seconds."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")


def wait_healthy(proc: "subprocess.Popen[str]", url: str, timeout: float, what: str,
                 output: Callable[[], str]) -> None:
    """Polls ``url``/health (bounded by ``timeout``) until it answers 200; a process that exits
    first, or a timeout, raises DgrError with the end of its ``output()``."""
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise DgrError(f"{what} exited ({proc.returncode}): {output()[-400:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise DgrError(f"{what} did not answer /health within {timeout:.0f}s")


class LlamaServer:
    """Stock ``llama-server`` at the pin on 127.0.0.1 (whole model, its OpenAI API)."""

    def __init__(self, model: Path, *, threads: int, parallel: int, ctx_per_slot: int = 1024,
                 backend: str = "cpu", port: int | None = None) -> None:
        from dgr.upstream.build import tool_binary
        from dgr.serve.server import free_port

        self.exe = tool_binary("llama-server", backend)
        self.port = port or free_port()
        self.cmd = [str(self.exe), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
                    "-c", str(parallel * ctx_per_slot), "-b", "512", "-ub", "512", "--host", "127.0.0.1",
                    "--port", str(self.port), "--no-webui",
                    # the model's template through llama.cpp's template API (llama_chat_apply_template),
                    # as dgr-worker's ApplyChatTemplate does: the same prompt tokens on every lane (the
                    # jinja engine would add the template's default system prompt: 2-3x the tokens)
                    "--no-jinja"]
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile("w+")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def start(self) -> "LlamaServer":
        self.proc = childproc.popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, text=True)

        def output() -> str:
            self._log.seek(0)
            return self._log.read()

        try:
            wait_healthy(self.proc, self.url, START_TIMEOUT_S, "llama-server", output)
        except DgrError:
            self.stop()
            raise
        return self

    def peak_rss_bytes(self) -> int:
        return status_bytes(self.pid, "VmHWM")

    def stop(self) -> None:
        from dgr.route.supervisor import stop_child

        if self.proc:
            stop_child(self.proc, 15)
        self._log.close()

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def measure_llama_server(model: Path, prompts: Sequence[str], *, threads: int, max_tokens: int,
                         sessions: Sequence[int] = (1, 4), backend: str = "cpu",
                         kv_bytes_per_cell: int = 0) -> tuple[list[str], list[dict[str, Any]], int, float]:
    """Stock llama-server (whole model, ``-np`` = the largest session count) answering the same
    chat prompts, greedy, stopping at end-of-generation like a route session. Per session
    count B: B=1 runs each prompt alone in turn (means), larger B sends B prompts at once.
    Returns (command, rows, peak RSS bytes, wall seconds); each row has the demo table's
    figures: sessions, ttft_s (mean), prefill_tok_s and decode_tok_s (aggregate),
    per_session_decode_tok_s, kv_bytes (positions held at the end x bytes per cell)."""

    async def level(url: str, ps: Sequence[str]) -> LevelResult:
        return await run_level(url, "llama", ps, max_tokens=max_tokens, lane="llama_server", stop_at_eos=True)

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with LlamaServer(model, threads=threads, parallel=max(sessions), backend=backend) as srv:
        asyncio.run(level(srv.url + "/v1", list(prompts[:1])))     # warm-up
        for b in sessions:
            if b == 1:
                runs = [asyncio.run(level(srv.url + "/v1", [p])) for p in prompts]
            else:
                runs = [asyncio.run(level(srv.url + "/v1", [prompts[i % len(prompts)] for i in range(b)]))]
            reqs = [r for lv in runs for r in lv.requests]
            bad = [r.error for r in reqs if r.error]
            if bad:
                raise DgrError(f"llama-server request failed: {bad[0]}")
            ttft = statistics.mean(r.ttft_s for r in reqs)
            dec = statistics.mean(lv.aggregate_decode_tok_s for lv in runs)
            prefill = statistics.mean(sum(r.prompt_tokens for r in lv.requests) / max(r.ttft_s for r in lv.requests)
                                      for lv in runs)
            held = max(sum(r.prompt_tokens + r.completion_tokens for r in lv.requests) for lv in runs)
            rows.append({"sessions": b, "ttft_s": ttft, "prefill_tok_s": prefill, "decode_tok_s": dec,
                         "per_session_decode_tok_s": dec / b, "kv_bytes": held * kv_bytes_per_cell})
        rss = srv.peak_rss_bytes()
        cmd = srv.cmd
    return cmd, rows, rss, time.perf_counter() - t0


def level_json(levels: Sequence[LevelResult]) -> list[dict[str, Any]]:
    return [lv.to_json() for lv in levels]


__all__ = ["LevelResult", "LlamaServer", "RequestResult", "asdict", "level_json", "proc_cpu_s", "run_level"]
