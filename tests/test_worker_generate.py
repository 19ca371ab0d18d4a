"""Server-side generation (StepFrame.generate) on one fake-model head+tail worker: the worker
feeds each sampled token back itself and answers one response per token (seconds, no GGUF)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dgr.shard.v1 import shard_runtime_pb2 as pb
from dgr.protocol.client import Sampling, ShardError, WorkerError, sampled
from dgr.route.supervisor import WorkerProcess
from fakeroute import poll

pytestmark = pytest.mark.native

PROMPTS = [[(7 * i + j * 13) % 250 + 1 for j in range(3 + 4 * i)] for i in range(4)]
N = 24


@pytest.fixture(scope="module")
def worker_bin(native_bin: Path) -> Path:
    env = os.environ.get("DGR_WORKER_BIN")
    return Path(env) if env else native_bin / "dgr-worker"


@pytest.fixture(scope="module")
def worker(worker_bin: Path):
    """Small prefill chunk: prompts go in several chunks, the last one generates."""
    with WorkerProcess.start(["--fake-model", "--max-prefill-chunk", "5"], binary=worker_bin) as w:
        yield w


@pytest.fixture(scope="module")
def slow(worker_bin: Path):
    """Each decode call sleeps: a long generation is still running when other frames arrive."""
    with WorkerProcess.start(["--fake-model", "--fake-delay-ms", "3"], binary=worker_bin) as w:
        yield w


def stepwise(client, prompt, n, sampling=None) -> list[int]:
    """n tokens: the one sampled after the prompt, then n - 1 client-stepped decodes."""
    with client.open_session(sampling=sampling) as s:
        first = s.prefill(prompt)
        out = [first, *s.generate(first, n - 1)]
        s.release()
    return out


def test_capability_advertises_server_generation(worker):
    cap = worker.client().capability()
    assert cap.capacity.server_generation and cap.capacity.chain_forwarding


@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"p{len(p)}" for p in PROMPTS])
def test_prefill_generate_equals_stepwise_decodes(worker, prompt):
    c = worker.client()
    ref = stepwise(c, prompt, N)
    fed0 = c.metric("dgr_generated_tokens_total")
    with c.open_session() as s:
        got = s.prefill_generate(prompt, N)
        chunks = -(-len(prompt) // 5)
        # the session stays open at the last position: the last token is not fed yet
        assert s.positions == len(prompt) + N - 1
        assert s.step == chunks + N - 1
        s.release()
    assert got == ref
    assert c.metric("dgr_generated_tokens_total") - fed0 == N - 1


def test_generated_responses_are_decode_steps_in_order(worker):
    c = worker.client()
    prompt = PROMPTS[0]   # one chunk
    with c.open_session() as s:
        s.send(s.generate_frame(pb.PHASE_PREFILL, prompt, 6))
        resps = s.read_generated(6)
        s.release()
    first, rest = resps[0], resps[1:]
    assert first.header.step == 0 and first.header.phase == pb.PHASE_PREFILL
    assert first.tail.tokens[0].position == len(prompt)
    for i, r in enumerate(rest):
        p = len(prompt) + i
        assert r.header.phase == pb.PHASE_DECODE and r.header.step == i + 1
        assert (r.header.positions.start, r.header.positions.end) == (p, p + 1)
        assert r.header.cached_positions == p + 1
        assert len(r.tail.tokens) == 1 and r.tail.tokens[0].position == p + 1


def test_decode_generate_continues_a_session_and_stepwise_continues_after_it(worker):
    c = worker.client()
    prompt = PROMPTS[2]
    ref = stepwise(c, prompt, 3 + 10 + 6)
    with c.open_session() as s:
        first = s.prefill(prompt)
        a = [first, *s.generate(first, 2)]                 # client-stepped
        b = s.decode_generate(a[-1], 10)                   # worker-generated
        assert s.positions == len(prompt) + 3 + 10 - 1
        c_ = s.generate(b[-1], 6)                          # client-stepped again (FastDecodeFrame)
        s.release()
    assert a + b + c_ == ref


def test_stop_token_ends_generation_unless_continue_after_finish(worker):
    c = worker.client()
    prompt = PROMPTS[0]
    ref = stepwise(c, prompt, N)
    stop = ref[5]
    k = ref.index(stop)
    samp = Sampling(stop_token_ids=(stop,), ignore_eog=False)   # ignore_eog also ignores stop tokens
    with c.open_session(sampling=samp) as s:
        got = s.prefill_generate(prompt, N)
        assert s.positions == len(prompt) + k
        s.release()
    assert got == ref[:k + 1]
    with c.open_session(sampling=samp) as s:
        s.send(s.generate_frame(pb.PHASE_PREFILL, prompt, N, continue_after_finish=True))
        resps = s.read_generated(N, continue_after_finish=True)
        s.release()
    assert [sampled(r) for r in resps] == ref
    assert resps[k].tail.tokens[0].finish_reason == pb.FINISH_REASON_STOP_TOKEN


def test_other_frames_during_generation_are_refused_and_the_session_continues(slow, worker):
    n = 200
    prompt = PROMPTS[3]
    ref = stepwise(worker.client(), prompt, n + 1)
    c = slow.client()
    with c.open_session(step_timeout=30) as s:
        s.send(s.generate_frame(pb.PHASE_PREFILL, prompt, n))
        first = s.recv()
        assert sampled(first) == ref[0]
        # while the worker generates: a fast decode and a full DECODE frame of the same session
        s.send(pb.SessionRequest(fast_decode=pb.FastDecodeFrame(
            session_id=s.session_id, route_epoch=s.epoch, step=first.header.step + 1,
            position=first.header.cached_positions, token_id=ref[0])))
        s.step, s.positions = first.header.step + 1, first.header.cached_positions
        s.send(s._input_frame(pb.PHASE_DECODE, [ref[0]], None, True))
        tokens, errors = [sampled(first)], []
        while len(tokens) < n:
            r = s.recv()
            if r.HasField("error"):
                errors.append(r.error)
            else:
                tokens.append(sampled(r))
                s.step, s.positions = r.header.step + 1, r.header.cached_positions
        assert tokens == ref[:n]
        assert [e.reason for e in errors] == [pb.ERROR_REASON_BAD_REQUEST] * 2, errors
        assert not any(e.session_terminated for e in errors)
        # the session goes on stepwise from where the generation left it
        assert s.positions == len(prompt) + n - 1
        assert s.decode(tokens[-1]) == ref[n]
        s.release()


def test_cancel_stops_a_running_generation(slow):
    c = slow.client()
    with c.open_session(step_timeout=30) as s:
        s.send(s.generate_frame(pb.PHASE_PREFILL, PROMPTS[0], 1500))
        for _ in range(3):
            assert not s.recv().HasField("error")
        assert c.cancel(s.session_id).cancelled
        seen, cancelled = 0, None
        with pytest.raises(WorkerError) as ei:
            while True:       # the remaining buffered tokens, then the terminal CANCELLED frame
                r = s.recv()
                if r.HasField("error"):
                    cancelled = r.error
                seen += 1
                assert seen < 1500, "generation went on after CancelSession"
        assert cancelled is not None and cancelled.reason == pb.ERROR_REASON_CANCELLED, cancelled
        assert cancelled.session_terminated
        assert ei.value.code.name == "CANCELLED"
    poll(lambda: c.load().active_sessions == 0, what="the cancelled session to be freed")


def test_release_stops_a_running_generation(slow):
    c = slow.client()
    s = c.open_session(step_timeout=30)
    s.send(s.generate_frame(pb.PHASE_PREFILL, PROMPTS[1], 1500))
    assert not s.recv().HasField("error")
    c.release(s.session_id)
    n = 0
    try:
        while True:
            r = s.recv(timeout=10)
            n += 1
            if r.HasField("error"):
                break
            assert n < 1500, "generation went on after ReleaseSession"
    except WorkerError:
        pass
    s.close()
    poll(lambda: c.load().active_sessions == 0, what="the released session to be freed")


def test_generate_on_a_non_sampling_frame_is_refused_or_ignored(worker):
    """generate without sample=true has nothing to continue from: never a generation."""
    c = worker.client()
    with c.open_session() as s:
        req = s._input_frame(pb.PHASE_PREFILL, PROMPTS[0], None, False)
        req.step.generate.CopyFrom(pb.GenerateParams(max_tokens=5))
        r = s.exchange(req, raise_errors=False)
        if not r.HasField("error"):
            assert not r.tail.tokens
            with pytest.raises(TimeoutError):
                s.recv(timeout=0.5)
        else:
            assert r.error.reason == pb.ERROR_REASON_BAD_REQUEST
        s.close()


def test_shard_error_type_for_refused_frames(worker):
    """A generate frame with a bad step is a structured error, like any frame."""
    c = worker.client()
    with c.open_session() as s:
        first = s.prefill(PROMPTS[0])
        s.step += 5
        with pytest.raises(ShardError) as ei:
            s.decode_generate(first, 4)
        assert ei.value.reason == pb.ERROR_REASON_STEP_OUT_OF_ORDER
        s.close()


def _gen_frame(s, prompt, n: int, per_answer: int) -> pb.SessionRequest:
    req = s.generate_frame(pb.PHASE_PREFILL, prompt, n)
    req.step.generate.tokens_per_answer = per_answer
    return req


def _read_tokens(s, n: int) -> tuple[list[pb.SessionResponse], list[int], pb.ShardError | None]:
    """Answers until n tokens or an error; returns the answers, their tokens and the error."""
    answers: list[pb.SessionResponse] = []
    tokens: list[int] = []
    while len(tokens) < n:
        r = s.recv()
        if r.HasField("error"):
            return answers, tokens, r.error
        answers.append(r)
        tokens += [t.token_id for t in r.tail.tokens]
        s.step, s.positions = r.header.step + 1, r.header.cached_positions
    return answers, tokens, None


def test_tokens_per_answer_groups_generated_tokens_in_order(worker):
    c = worker.client()
    prompt = PROMPTS[0]   # one chunk
    ref = stepwise(c, prompt, N)
    with c.open_session() as s:
        s.send(_gen_frame(s, prompt, N, 4))
        answers, tokens, err = _read_tokens(s, N)
        s.release()
    assert err is None and tokens == ref
    assert len(answers[0].tail.tokens) == 1 and answers[0].header.phase == pb.PHASE_PREFILL   # the first at once
    assert all(1 <= len(a.tail.tokens) <= 4 for a in answers[1:])
    assert len(answers) < N, "a fast generation should group tokens"
    done = 1
    for a in answers[1:]:
        k = len(a.tail.tokens)
        p0 = len(prompt) + done - 1                      # input position of the first token's step
        assert (a.header.positions.start, a.header.positions.end) == (p0, p0 + k)
        assert [t.position for t in a.tail.tokens] == list(range(p0 + 1, p0 + k + 1))
        assert a.header.step == done + k - 1             # the last token's step
        assert a.header.cached_positions == p0 + k
        done += k
    assert done == N


def test_held_tokens_go_out_before_an_error(worker_bin):
    """A KV budget reached mid-generation: every token sampled before it arrives, then the error."""
    prompt = PROMPTS[1]
    with WorkerProcess.start(["--fake-model", "--kv-cells", "40", "--max-sessions", "1"], binary=worker_bin) as w:
        c = w.client()
        ref = stepwise(c, prompt, 20)
        with c.open_session() as s:
            s.send(_gen_frame(s, prompt, 100, 8))
            answers, tokens, err = _read_tokens(s, 100)
    assert err is not None and err.reason == pb.ERROR_REASON_OVER_BUDGET, err
    assert len(tokens) == 40 - len(prompt) + 1       # every cell filled, the last token not fed
    assert tokens[:20] == ref
    assert len(answers) < len(tokens)


def test_held_tokens_wait_at_most_about_50_ms(worker_bin):
    """At 30 ms per token, 8 tokens per answer would hold the first one 210 ms: the worker sends
    what it holds after 50 ms instead (and at once when tokens come more than 50 ms apart)."""
    prompt = PROMPTS[0]
    with WorkerProcess.start(["--fake-model", "--fake-delay-ms", "30"], binary=worker_bin) as w:
        c = w.client()
        with c.open_session(step_timeout=30) as s:
            s.send(_gen_frame(s, prompt, 24, 8))
            answers, tokens, err = _read_tokens(s, 24)
            s.release()
    assert err is None and len(tokens) == 24
    assert max(len(a.tail.tokens) for a in answers) <= 4, [len(a.tail.tokens) for a in answers]
