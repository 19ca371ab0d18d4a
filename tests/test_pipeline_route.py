"""Pipelined scheduling on a chained route of fake-model workers (docs/worker.md, Pipelined
routes): with ``--pipeline-groups N`` the head batches at most ceil(sessions / N) chained decode
rows and sends a long prompt down the route in pieces, and the tokens stay exactly those of
the same route driven step by step (no pipelining there). No timing assertions.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from dgr.route.driver import RouteDriver
from fakeroute import start_fake

pytestmark = pytest.mark.native

GROUPS = 3
SESSIONS = 6
PROMPT_LEN = 100          # one prefill frame; the head splits it into pieces of 32 rows


@pytest.fixture(scope="module")
def route(native_bin):
    procs = []
    try:
        for r in ("0:3", "3:5", "5:8"):
            procs.append(start_fake(native_bin, "--layers", r, "--pipeline-groups", str(GROUPS)))
        yield procs
    finally:
        for p in procs:
            p.kill()


def _prompts() -> list[list[int]]:
    return [[256, *[(7 * i + 13 * k) % 250 for k in range(PROMPT_LEN - 1)]] for i in range(SESSIONS)]


async def _run(endpoints: list[str], *, chain: bool) -> list:
    d = await RouteDriver(endpoints, chain=chain).connect()
    try:
        assert d.mode == ("chained" if chain else "stepwise")
        return await asyncio.gather(*(d.generate(p, max_tokens=20, stop_on_eog=False) for p in _prompts()))
    finally:
        await d.close()


def _metrics(w) -> dict[str, float]:
    with w.client() as c:
        return {n: c.metric(n) for n in ("dgr_prefill_pieces_total", "dgr_decode_only_rows_total",
                                         "dgr_decode_only_batches_total", "dgr_sessions_opened_pipelined_total")}


def test_pipelined_route_keeps_the_tokens_and_splits_the_work(route):
    eps = [p.target for p in route]
    head = route[0]
    before = [_metrics(w) for w in route]
    step = asyncio.run(_run(eps, chain=False))
    m0 = _metrics(head)
    stepped = [_metrics(w) for w in route]
    chained = asyncio.run(_run(eps, chain=True))
    m1 = _metrics(head)
    after = [_metrics(w) for w in route]
    for c, s in zip(chained, step):
        assert c.error is None and s.error is None, (c.error, s.error)
        assert len(c.tokens) == 20 and c.tokens == s.tokens
    # each 100-token prompt went down the route in pieces of 32 rows: 4 per session
    assert m1["dgr_prefill_pieces_total"] - m0["dgr_prefill_pieces_total"] == SESSIONS * math.ceil(PROMPT_LEN / 32)
    # no head decode call took more than one group of rows, so their mean cannot exceed it
    rows = m1["dgr_decode_only_rows_total"] - m0["dgr_decode_only_rows_total"]
    batches = m1["dgr_decode_only_batches_total"] - m0["dgr_decode_only_batches_total"]
    assert batches > 0 and rows / batches <= math.ceil(SESSIONS / GROUPS)
    # the pipelining head marks the sessions it opens downstream (StepFrame.pipelined) and the
    # middle Shard passes the mark on; the route driver's own sessions carry none
    opened = "dgr_sessions_opened_pipelined_total"
    assert [s[opened] - b[opened] for s, b in zip(stepped, before)] == [0, 0, 0]
    assert [a[opened] - s[opened] for a, s in zip(after, stepped)] == [0, SESSIONS, SESSIONS]


def test_pipeline_groups_out_of_range_is_refused(native_bin):
    import subprocess

    p = subprocess.run([str(native_bin / "dgr-worker"), "serve", "--fake-model", "--pipeline-groups", "17"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--pipeline-groups wants 0 (auto) .. 16" in p.stderr
