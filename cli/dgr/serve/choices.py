"""A request's ``n`` choices: ``n`` route sessions of the same prompt, run side by side.

Choice ``i`` samples with the request's seed + ``i`` (mod 2**64), so that a seeded request gives
the same ``n`` answers again while its choices differ; unseeded choices draw their own seeds;
greedy choices are all the same answer (as with OpenAI). The ``n`` admission slots are taken
together or not at all (429), so that requests holding some slots never wait on each other for
the rest. One choice (the usual case) is its generation, with no task or queue in between.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, AsyncIterator

from .engine import Delta, Generation, GatewayError, Params, TokenLogprob, Usage

if TYPE_CHECKING:
    from .engine import Engine

MAX_CHOICES = 8


def choice_params(params: Params, i: int) -> Params:
    if i == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % 2**64)


class Choices:
    def __init__(self, engine: "Engine", prompt_ids: list[int], params: Params, n: int = 1,
                 t0: float | None = None) -> None:
        if not 1 <= n <= MAX_CHOICES:
            raise GatewayError(400, f"n must be between 1 and {MAX_CHOICES}, got {n}", param="n",
                               code="invalid_value")
        if n > engine.admission.slots:
            raise GatewayError(400, f"n={n} exceeds the {engine.admission.slots} sessions this gateway runs at once",
                               param="n", code="invalid_value")
        self.engine = engine
        self.gens = [Generation(engine, prompt_ids, choice_params(params, i), t0) for i in range(n)]
        self._started = False

    @property
    def params(self) -> Params:
        return self.gens[0].params

    @property
    def usage(self) -> Usage:
        """The prompt once, the completion tokens of every choice."""
        return Usage(prompt_tokens=self.gens[0].usage.prompt_tokens,
                     completion_tokens=sum(g.usage.completion_tokens for g in self.gens))

    @property
    def ttft_s(self) -> float | None:
        got = [g.ttft_s for g in self.gens if g.ttft_s is not None]
        return min(got) if got else None

    def finish_reason(self, i: int) -> str | None:
        return self.gens[i].finish_reason

    async def start(self) -> None:
        """Starts every choice's session; with n > 1 all n admission slots are taken at once or
        the request is refused (429) before anything runs."""
        if len(self.gens) == 1:
            await self.gens[0].start()
            return
        if self._started:
            return
        self.engine.admission.take_now(len(self.gens))
        self._started = True
        try:
            for g in self.gens:
                await g.start(slot_taken=True)
        except BaseException:
            await self.close()   # a started choice frees its own slot; the rest are handed back here
            for g in self.gens:
                if not g.started:
                    self.engine.admission.release()
            raise

    async def close(self) -> None:
        for g in self.gens:
            await g.close()

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) in the order the deltas come; ends every session however it
        ends (a failure of one choice fails the request)."""
        if len(self.gens) == 1:
            async for d in self.gens[0].deltas():
                yield 0, d
            return
        await self.start()
        q: asyncio.Queue[tuple[int, Delta | None, BaseException | None]] = asyncio.Queue()

        async def pump(i: int, g: Generation) -> None:
            try:
                async for d in g.deltas():
                    q.put_nowait((i, d, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
                q.put_nowait((i, None, exc))
                return
            q.put_nowait((i, None, None))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.gens)]
        try:
            left = len(tasks)
            while left:
                i, d, exc = await q.get()
                if exc is not None:
                    raise exc
                if d is None:
                    left -= 1
                    continue
                yield i, d
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()

    async def collect_all(self) -> list[tuple[str, list[TokenLogprob]]]:
        """Every choice's text and logprobs, in choice order."""
        texts: list[list[str]] = [[] for _ in self.gens]
        lps: list[list[TokenLogprob]] = [[] for _ in self.gens]
        async for i, d in self.deltas():
            texts[i].append(d.text)
            lps[i].extend(d.logprobs)
        return [("".join(t), lp) for t, lp in zip(texts, lps)]
