"""A Shard worker in Python: one layer range of a safetensors checkpoint, run with Transformers,
served over Shard protocol v1 (``ShardRuntimeService``, the generated code in ``dgr.shard.v1``).

It is the *distributed safetensors route* the release gate (DGR-014) compares the GGUF route
with: the same route driver, the same frames, the same boundary bundle (``residual`` f32
[n_tokens, n_embd], the unnormalized hidden state entering the next layer), so the two routes
differ only in the runtime behind the protocol. That also shows the protocol is backend-neutral.

What it serves (deliberately a baseline, not a second runtime):

- the layers ``[start, end)`` of a Llama-family checkpoint, loaded tensor by tensor from the
  ``*.safetensors`` files (only the owned blocks; the embedding on the head and, for tied
  embeddings, on the tail; final norm and LM head on the tail), fp32 (or ``--dtype bf16``);
- one Hot KV cache (a Transformers ``DynamicCache``) per Route Session, local to this process;
- prefill chunks and single-token decode steps (``StepFrame`` and ``FastDecodeFrame``), with the
  stateless frame checks of :func:`dgr.protocol.frame_checks.check_request` and the session checks (epoch, step
  order, cache expectation, budget) answering the documented ``ErrorReason``;
- greedy or seeded stochastic sampling with top-k logprobs on the tail;
- Tokenize/Detokenize (the checkpoint's tokenizer), Release/Cancel, GetMetrics (load snapshot,
  step counters and latency sums in the dgr-worker's metric names).

Sessions are computed one step at a time on one compute thread (no continuous batching, no
chained forwarding, no server-side generation: the driver runs this route stepwise).

Needs the ``baseline`` extra (torch, transformers, safetensors). Run::

    python -m dgr.bench.hf_worker --model-dir HF_DIR --layers 0:15 --listen 127.0.0.1:0

The first stdout line is ``dgr-hf-worker: listening on HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from .. import __version__
from ..protocol.bundle import ShardProtocolError, boundary_bundle, frame_payload_checksum, read_boundary
from ..protocol.frame_checks import check_request
from ..protocol.keepalive import server_options
from ..shard.v1 import shard_runtime_pb2 as pb
from ..shard.v1 import shard_runtime_pb2_grpc as pbg
from .hf_model import BACKEND, RangeModel, artifact_id_of, fingerprint_of, recipe_json, sample  # noqa: F401

MAX_MESSAGE_BYTES = 64 << 20
MAX_FRAGMENT_BYTES = 1 << 20


# ---- sessions and the service -----------------------------------------------------------------

@dataclass
class Session:
    sid: str
    epoch: int
    cache: Any
    positions: int = 0
    next_step: int = 0
    sampling: pb.SamplingParams = field(default_factory=pb.SamplingParams)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    last: pb.SessionResponse | None = None     # the answer of step next_step - 1 (idempotent replay)


class Metrics:
    def __init__(self) -> None:
        self.c: dict[str, float] = {k: 0.0 for k in (
            "dgr_steps_total", "dgr_replayed_steps_total", "dgr_step_errors_total", "dgr_batches_total",
            "dgr_batch_rows_total", "dgr_prefill_tokens_total", "dgr_decode_tokens_total",
            "dgr_decode_busy_seconds_total", "dgr_decode_only_busy_seconds_total", "dgr_decode_only_batches_total",
            "dgr_decode_only_rows_total", "dgr_sessions_opened_total", "dgr_sessions_released_total",
            "dgr_sessions_cancelled_total", "dgr_step_latency_seconds_sum", "dgr_step_latency_seconds_count",
            "dgr_queue_wait_seconds_sum", "dgr_queue_wait_seconds_count")}
        self.rejected: dict[str, float] = {"sessions": 0.0, "kv": 0.0}

    def add(self, name: str, v: float = 1.0) -> None:
        self.c[name] += v


class HfShardService(pbg.ShardRuntimeServiceServicer):
    def __init__(self, rm: RangeModel, model_dir: Path, *, artifact_id: str, dtype: str, max_sessions: int,
                 ctx_per_session: int, max_chunk: int) -> None:
        self.rm = rm
        self.max_sessions, self.ctx, self.max_chunk = max_sessions, ctx_per_session, max_chunk
        recipe = recipe_json(artifact_id, dtype, rm.n_layer)
        self.capability = pb.GetCapabilityResponse(
            schema_version=pb.SCHEMA_VERSION_V1, min_schema_version=pb.SCHEMA_VERSION_V1,
            identity=pb.ShardIdentity(artifact_id=artifact_id, recipe_json=recipe,
                                      compatibility_fingerprint=fingerprint_of(recipe),
                                      range=pb.ShardRange(start=rm.start, end=rm.end), n_layer=rm.n_layer,
                                      head=rm.head, tail=rm.tail, n_embd=rm.n_embd, n_vocab=rm.n_vocab,
                                      architecture="llama"),
            capacity=pb.Capacity(max_sessions=max_sessions, kv_cells=max_sessions * ctx_per_session,
                                 max_session_positions=ctx_per_session, max_batch_tokens=max_chunk,
                                 max_prefill_chunk_tokens=max_chunk, max_message_bytes=MAX_MESSAGE_BYTES,
                                 max_fragment_bytes=MAX_FRAGMENT_BYTES, compressions=[pb.COMPRESSION_NONE],
                                 server_generation=False, chain_forwarding=False, weight_bytes=rm.weight_bytes,
                                 kv_bytes=rm.kv_bytes_per_cell * max_sessions * ctx_per_session),
            runtime=pb.RuntimeInfo(dgr_version=__version__, backend=f"{BACKEND}-cpu"))
        self.sessions: dict[str, Session] = {}
        self.closed: dict[str, int] = {}       # released/cancelled session -> epoch (answer SESSION_RELEASED)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hf-compute")   # one step at a time
        self.metrics = Metrics()
        self.queued = 0
        self.tokenizer = None
        self.model_dir = model_dir

    # -- unary RPCs --
    async def GetCapability(self, request, context):
        return self.capability

    async def GetMetrics(self, request, context):
        with self.lock:
            used = sum(s.positions for s in self.sessions.values())
            load = pb.LoadSnapshot(active_sessions=len(self.sessions), kv_cells_used=used,
                                   kv_cells_total=self.max_sessions * self.ctx, queued_steps=self.queued)
            samples = [pb.MetricSample(name=k, value=v) for k, v in self.metrics.c.items()]
            samples += [pb.MetricSample(name="dgr_rejected_admissions_total", labels={"reason": r}, value=v)
                        for r, v in self.metrics.rejected.items()]
        samples += [pb.MetricSample(name="dgr_active_sessions", value=load.active_sessions),
                    pb.MetricSample(name="dgr_kv_cells_used", value=load.kv_cells_used),
                    pb.MetricSample(name="dgr_kv_cells_total", value=load.kv_cells_total)]
        return pb.GetMetricsResponse(load=load, samples=samples)

    def _drop(self, sid: str, epoch: int, counter: str) -> tuple[bool, int]:
        with self.lock:
            s = self.sessions.get(sid)
            if s is None or (epoch and s.epoch != epoch):
                return False, 0
            del self.sessions[sid]
            self.closed[sid] = s.epoch
            self.metrics.add(counter)
            return True, s.positions

    async def ReleaseSession(self, request, context):
        ok, freed = self._drop(request.session_id, request.route_epoch, "dgr_sessions_released_total")
        return pb.ReleaseSessionResponse(released=ok, freed_kv_cells=freed)

    async def CancelSession(self, request, context):
        ok, _ = self._drop(request.session_id, request.route_epoch, "dgr_sessions_cancelled_total")
        return pb.CancelSessionResponse(cancelled=ok)

    def _tok(self):
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        return self.tokenizer

    async def Tokenize(self, request, context):
        ids = self._tok()(request.text, add_special_tokens=request.add_special)["input_ids"]
        return pb.TokenizeResponse(token_ids=list(ids))

    async def Detokenize(self, request, context):
        tok = self._tok()
        ids = list(request.token_ids)
        text = tok.decode(ids, skip_special_tokens=request.remove_special).encode()
        pieces = [tok.decode([i]).encode() for i in ids] if request.include_pieces else []
        return pb.DetokenizeResponse(text=text, pieces=pieces)

    # -- the session stream --
    async def Session(self, request_iterator, context):
        """One session stream. The client's half-close ends the sessions it carried, as on the
        native worker (a normal finish sends no ReleaseSession: one round)."""
        loop = asyncio.get_running_loop()
        carried: dict[str, int] = {}
        async for req in request_iterator:
            t0 = time.perf_counter()
            kind = req.WhichOneof("frame")
            if kind == "fast_decode":
                carried[req.fast_decode.session_id] = req.fast_decode.route_epoch
            elif kind == "step":
                carried[req.step.header.session_id] = req.step.header.route_epoch
            with self.lock:
                self.queued += 1
            try:
                resp = await loop.run_in_executor(self.pool, self._step, req, t0)
            finally:
                with self.lock:
                    self.queued -= 1
            yield resp
        # grpc.aio ends the request iterator the same way on a half-close and on the client's
        # cancel; a cancel then cancels this handler at its next await. An aborted stream keeps
        # its sessions, as on the native worker (released or reaped later); should a cancel come
        # later than this, its sessions are dropped as on a half-close (no harm: nothing uses them).
        await asyncio.sleep(0.01)
        if context.cancelled():
            return
        for sid, epoch in carried.items():    # half-closed: the stream's sessions end with it
            self._drop(sid, epoch, "dgr_sessions_released_total")

    def _step(self, req: pb.SessionRequest, t0: float) -> pb.SessionResponse:
        waited = time.perf_counter() - t0
        hdr = pb.ResponseHeader(schema_version=pb.SCHEMA_VERSION_V1)
        try:
            return self._run(req, hdr, waited, t0)
        except ShardProtocolError as exc:
            with self.lock:
                self.metrics.add("dgr_step_errors_total")
            terminated = exc.reason in (pb.ERROR_REASON_OVER_BUDGET, pb.ERROR_REASON_INTERNAL)
            return pb.SessionResponse(header=hdr, error=exc.to_message(session_terminated=terminated))
        except Exception as exc:  # a compute failure ends this session, not the worker
            with self.lock:
                self.metrics.add("dgr_step_errors_total")
                self.sessions.pop(hdr.session_id, None)
            return pb.SessionResponse(header=hdr, error=pb.ShardError(
                reason=pb.ERROR_REASON_INTERNAL, grpc_code=13, message=f"transformers step failed: {exc}",
                session_terminated=True))

    def _run(self, req: pb.SessionRequest, hdr: pb.ResponseHeader, waited: float, t0: float) -> pb.SessionResponse:
        check_request(req, self.capability)
        kind = req.WhichOneof("frame")
        if kind == "fast_decode":
            f = req.fast_decode
            sid, epoch, step, pos0, n = f.session_id, f.route_epoch, f.step, f.position, 1
            phase, request_id = pb.PHASE_DECODE, f.request_id
            tokens = [f.token_id] if f.WhichOneof("input") == "token_id" else None
            bundle = f.bundle if tokens is None else None
            expect = pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_POSITION, position=pos0)
            sampling, sample_now = None, True
        else:
            s = req.step
            h = s.header
            sid, epoch, step, phase, request_id = h.session_id, h.route_epoch, h.step, h.phase, h.request_id
            pos0, n = h.positions.start, h.positions.end - h.positions.start
            tokens = list(s.tokens.token_ids) if s.WhichOneof("input") == "tokens" else None
            bundle = s.bundle if s.WhichOneof("input") == "bundle" else None
            expect = h.cache_expectation
            sampling = s.sampling if s.HasField("sampling") else None
            sample_now = s.sample
        hdr.request_id, hdr.session_id, hdr.route_epoch, hdr.step, hdr.phase = request_id, sid, epoch, step, phase
        hdr.positions.start, hdr.positions.end = pos0, pos0 + n
        hdr.computed_range.start, hdr.computed_range.end = self.rm.start, self.rm.end
        hdr.compression = pb.COMPRESSION_NONE
        if phase in (pb.PHASE_RELEASE, pb.PHASE_TRUNCATE):
            if phase == pb.PHASE_TRUNCATE:
                raise ShardProtocolError(pb.ERROR_REASON_BAD_REQUEST, "TRUNCATE is not supported by this worker")
            ok, _ = self._drop(sid, epoch, "dgr_sessions_released_total")
            hdr.cache_result = pb.CACHE_RESULT_HIT if ok else pb.CACHE_RESULT_MISS
            return pb.SessionResponse(header=hdr)
        sess = self._session_for(sid, epoch, step, expect, pos0, n)
        if isinstance(sess, pb.SessionResponse):
            return sess                                    # an idempotent replay
        if sampling is not None:
            sess.sampling = sampling
            sess.rng = np.random.default_rng(sampling.seed)
        residual = None
        if tokens is None:
            residual = read_boundary(bundle, n_tokens=n, n_embd=self.rm.n_embd,
                                     max_fragment_bytes=MAX_FRAGMENT_BYTES)
        c0 = time.perf_counter()
        out = self.rm.forward(sess.cache, pos0, tokens, residual)
        busy = time.perf_counter() - c0
        sess.positions = pos0 + n
        sess.next_step = step + 1
        hdr.cache_result = pb.CACHE_RESULT_HIT if pos0 else pb.CACHE_RESULT_UNSPECIFIED
        hdr.cached_positions = sess.positions
        resp = pb.SessionResponse(header=hdr)
        if not self.rm.tail:
            resp.boundary.CopyFrom(boundary_bundle(out, fragment_bytes=MAX_FRAGMENT_BYTES))
            resp.header.payload_checksum.CopyFrom(frame_payload_checksum(resp.boundary))
        elif sample_now:
            tok, lp, top = sample(out, sess.sampling, sess.rng)
            st = pb.SampledToken(token_id=tok, position=pos0 + n, logprob=lp,
                                 top_logprobs=[pb.TokenLogprob(token_id=i, logprob=v) for i, v in top])
            if tok in sess.sampling.stop_token_ids:
                st.finish_reason = pb.FINISH_REASON_STOP_TOKEN
            elif tok in self.rm.eos and not sess.sampling.ignore_eog:
                st.finish_reason = pb.FINISH_REASON_EOG
            resp.tail.tokens.append(st)
        else:
            resp.tail.SetInParent()
        sess.last = resp
        with self.lock:
            m = self.metrics
            m.add("dgr_steps_total")
            m.add("dgr_batches_total")
            m.add("dgr_batch_rows_total", n)
            m.add("dgr_decode_busy_seconds_total", busy)
            if phase == pb.PHASE_DECODE:
                m.add("dgr_decode_tokens_total", n)
                m.add("dgr_decode_only_busy_seconds_total", busy)
                m.add("dgr_decode_only_batches_total")
                m.add("dgr_decode_only_rows_total", n)
            else:
                m.add("dgr_prefill_tokens_total", n)
            m.add("dgr_queue_wait_seconds_sum", waited)
            m.add("dgr_queue_wait_seconds_count")
            m.add("dgr_step_latency_seconds_sum", time.perf_counter() - t0)
            m.add("dgr_step_latency_seconds_count")
        return resp

    def _session_for(self, sid: str, epoch: int, step: int, expect: pb.CacheExpectation, pos0: int,
                     n: int) -> Session | pb.SessionResponse:
        with self.lock:
            sess = self.sessions.get(sid)
            if sess is not None and epoch < sess.epoch:
                raise ShardProtocolError(pb.ERROR_REASON_STALE_EPOCH, f"epoch {epoch} < current {sess.epoch}")
            if sess is not None and epoch > sess.epoch:   # a newer epoch starts from token zero
                del self.sessions[sid]
                sess = None
            if sess is not None and step < sess.next_step:
                if step == sess.next_step - 1 and sess.last is not None:
                    replay = pb.SessionResponse()
                    replay.CopyFrom(sess.last)
                    replay.header.replayed = True
                    self.metrics.add("dgr_replayed_steps_total")
                    return replay
                raise ShardProtocolError(pb.ERROR_REASON_STEP_OUT_OF_ORDER,
                                         f"step {step} after step {sess.next_step - 1}")
            if sess is not None and step > sess.next_step:
                raise ShardProtocolError(pb.ERROR_REASON_STEP_OUT_OF_ORDER,
                                         f"step {step}, expected {sess.next_step}")
            empty = expect.kind == pb.CACHE_EXPECTATION_KIND_EMPTY
            if sess is None:
                if self.closed.get(sid) == epoch and epoch:
                    raise ShardProtocolError(pb.ERROR_REASON_SESSION_RELEASED, f"session {sid} was released")
                if not empty or pos0 != 0:
                    raise ShardProtocolError(pb.ERROR_REASON_CACHE_MISS,
                                             f"no cache for session {sid} (expected position {pos0})")
                if len(self.sessions) >= self.max_sessions:
                    self.metrics.rejected["sessions"] += 1
                    raise ShardProtocolError(pb.ERROR_REASON_OVER_BUDGET,
                                             f"{self.max_sessions} sessions active", limit=self.max_sessions)
                sess = Session(sid, epoch, self.rm.new_cache())
                self.sessions[sid] = sess
                self.closed.pop(sid, None)
                self.metrics.add("dgr_sessions_opened_total")
            elif empty or pos0 != sess.positions:
                raise ShardProtocolError(pb.ERROR_REASON_CACHE_MISS,
                                         f"session {sid} holds {sess.positions} positions, frame starts at {pos0}")
            if pos0 + n > self.ctx:
                self.metrics.rejected["kv"] += 1
                raise ShardProtocolError(pb.ERROR_REASON_OVER_BUDGET,
                                         f"positions up to {pos0 + n} above the session budget {self.ctx}",
                                         limit=self.ctx)
            return sess


async def serve(args: argparse.Namespace) -> None:
    a, b = (int(x) for x in args.layers.split(":"))
    model_dir = Path(args.model_dir)
    artifact = args.artifact_id or artifact_id_of(model_dir)
    rm = RangeModel(model_dir, a, b, dtype=args.dtype, threads=args.threads)
    svc = HfShardService(rm, model_dir, artifact_id=artifact, dtype=args.dtype, max_sessions=args.max_sessions,
                         ctx_per_session=args.ctx_per_session, max_chunk=args.max_prefill_chunk)
    # the route's channels ping every second (keepalive_options); without this policy the server
    # answers the third ping with GOAWAY too_many_pings and fails the call in flight
    server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      *server_options()])
    pbg.add_ShardRuntimeServiceServicer_to_server(svc, server)
    port = server.add_insecure_port(args.listen)
    if not port:
        raise SystemExit(f"dgr-hf-worker: cannot listen on {args.listen}")
    await server.start()
    host = args.listen.rsplit(":", 1)[0]
    print(f"dgr-hf-worker: listening on {host}:{port}", flush=True)
    print(f"dgr-hf-worker: serving layers {a}:{b} of {rm.n_layer} ({args.dtype}, fingerprint "
          f"{svc.capability.identity.compatibility_fingerprint[:16]})", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgr.bench.hf_worker",
                                 description="Serve one layer range of a safetensors checkpoint with Transformers "
                                             "over Shard protocol v1.")
    ap.add_argument("--model-dir", required=True, help="directory with config.json, *.safetensors, tokenizer")
    ap.add_argument("--layers", required=True, help="layer range START:END")
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: a free one)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--max-sessions", type=int, default=8)
    ap.add_argument("--ctx-per-session", type=int, default=2048)
    ap.add_argument("--max-prefill-chunk", type=int, default=512)
    ap.add_argument("--artifact-id", default="", help="artifact id (default: sha256 of the safetensors)")
    args = ap.parse_args(argv)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
