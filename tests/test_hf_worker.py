"""The transformers shard worker (dgr.bench.hf_worker) speaks Shard protocol v1: a route of two
of them reproduces the whole Transformers model, and it answers protocol faults with the
documented reasons. A tiny random Llama written with save_pretrained: no download."""

from __future__ import annotations

import asyncio
import math

import pytest

pytestmark = pytest.mark.baseline

N_LAYER = 4
VOCAB = 64          # <= 64: the top-64 logprobs cover the whole vocabulary (exact scoring)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=N_LAYER,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(str(d), safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def hf_route(tiny_ckpt):
    from dgr.bench.hf_route import HfRoute

    with HfRoute(tiny_ckpt, [(0, 1), (1, N_LAYER)], threads=1, max_sessions=2, ctx_per_session=64,
                 artifact_id="tiny") as r:
        yield r


PROMPTS = [[1, 5, 9, 13], [1, 40, 41, 42, 43, 44, 45], [3]]


def test_route_reproduces_the_whole_transformers_model(tiny_ckpt, hf_route):
    from dgr.bench.gate import greedy
    from dgr.bench.hf_route import whole_model_greedy

    got = asyncio.run(greedy(hf_route.endpoints, PROMPTS, 12))
    ref = [r["tokens"] for r in whole_model_greedy(tiny_ckpt, PROMPTS, 12, threads=1)]
    assert got == ref and all(len(g) == 12 for g in got)


def test_teacher_forced_scoring_matches_torch(tiny_ckpt, hf_route):
    import torch
    from transformers import AutoModelForCausalLM

    from dgr.bench.gate import score_text

    ids = [1, *range(3, 40)]
    got = asyncio.run(score_text(hf_route.endpoints, ids, chunk=16, top=64))
    m = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32)
    nll, argmax = 0.0, []
    with torch.inference_mode():
        for c0 in range(0, len(ids) - 1, 16):
            part = ids[c0:c0 + 17]
            lp = torch.log_softmax(m(torch.tensor([part])).logits[0].double(), -1)
            for i in range(len(part) - 1):
                argmax.append(int(lp[i].argmax()))
                nll -= float(lp[i, part[i + 1]])
    assert got["clipped"] == 0 and got["n_scored"] == len(ids) - 1
    assert got["argmax"] == argmax
    assert got["perplexity"] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-4)


def test_capability_and_cleanup(hf_route):
    from dgr.protocol.client import WorkerClient

    head, tail = (WorkerClient(e, timeout=30) for e in hf_route.endpoints)
    with head, tail:
        ch, ct = head.capability(), tail.capability()
        assert ch.identity.head and not ch.identity.tail and ct.identity.tail
        assert (ch.identity.range.start, ch.identity.range.end, ct.identity.range.end) == (0, 1, N_LAYER)
        assert ch.identity.compatibility_fingerprint == ct.identity.compatibility_fingerprint
        assert not ch.capacity.chain_forwarding and ch.runtime.backend.startswith("transformers")
        # every session the earlier tests ran was released on both shards
        for c in (head, tail):
            load = c.metrics().load
            assert load.active_sessions == 0 and load.kv_cells_used == 0


def test_protocol_faults_answer_documented_reasons(hf_route):
    from dgr.route.driver import RouteDriver

    from dgr.shard.v1 import shard_runtime_pb2 as pb

    def opening_header(cap, sid: str, rid: str) -> pb.FrameHeader:
        """The header of a one-token PREFILL that opens session `sid` (epoch 1) on this shard."""
        r = cap.identity.range
        return pb.FrameHeader(schema_version=pb.SCHEMA_VERSION_V1, request_id=rid, session_id=sid, route_epoch=1,
                              compatibility_fingerprint=cap.identity.compatibility_fingerprint,
                              shard_range=pb.ShardRange(start=r.start, end=r.end), effective_start=r.start,
                              phase=pb.PHASE_PREFILL, positions=pb.PositionRange(start=0, end=1), step=0,
                              cache_expectation=pb.CacheExpectation(kind=pb.CACHE_EXPECTATION_KIND_EMPTY),
                              compression=pb.COMPRESSION_NONE)

    async def main():
        d = await RouteDriver(hf_route.endpoints).connect()
        try:
            head = d.shards[0]
            call = head.client.stub.Session()
            # a decode step for a session this shard never saw: a cache miss
            await call.write(pb.SessionRequest(fast_decode=pb.FastDecodeFrame(
                session_id="nope", route_epoch=1, step=0, position=3, token_id=5)))
            miss = await call.read()
            # a frame for another fingerprint
            h = opening_header(head.capability, "s1", "r1")
            h.compatibility_fingerprint = "0" * 64
            await call.write(pb.SessionRequest(step=pb.StepFrame(header=h, tokens=pb.TokenSpan(token_ids=[1]))))
            fp = await call.read()
            # a token outside the vocabulary
            h2 = opening_header(head.capability, "s2", "r2")
            await call.write(pb.SessionRequest(step=pb.StepFrame(header=h2, tokens=pb.TokenSpan(token_ids=[VOCAB]))))
            vocab = await call.read()
            # over the session budget (2): two open sessions hold it, a third is refused
            opened = []
            for sid in ("a", "b", "c"):
                h3 = opening_header(head.capability, sid, f"r-{sid}")
                await call.write(pb.SessionRequest(step=pb.StepFrame(header=h3, tokens=pb.TokenSpan(token_ids=[1]))))
                opened.append(await call.read())
            call.cancel()
            freed = [await head.client.stub.ReleaseSession(pb.ReleaseSessionRequest(session_id=sid, route_epoch=1))
                     for sid in ("a", "b")]
            left = (await head.client.stub.GetMetrics(pb.GetMetricsRequest())).load.active_sessions
            return miss, fp, vocab, opened, freed, left
        finally:
            await d.close()

    miss, fp, vocab, opened, freed, left = asyncio.run(main())
    assert miss.error.reason == pb.ERROR_REASON_CACHE_MISS
    assert fp.error.reason == pb.ERROR_REASON_FINGERPRINT_MISMATCH
    assert vocab.error.reason == pb.ERROR_REASON_TOKEN_OUT_OF_VOCAB
    assert [o.WhichOneof("result") for o in opened] == ["boundary", "boundary", "error"]
    assert opened[2].error.reason == pb.ERROR_REASON_OVER_BUDGET
    assert all(f.released and f.freed_kv_cells == 1 for f in freed) and left == 0
