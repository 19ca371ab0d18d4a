"""`dgr bench replicas` end to end on a tiny synthetic model (labelled synthetic: the figures
say nothing about speed): two lab hosts, one gateway over one replica and one over both, the
requests spread over both routes, one ratio per repeat."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.native]


def test_replicas_bench_runs_both_lanes_and_spreads_requests(tmp_path, lab_worker):
    from dgr.bench.replicas import ReplicaBenchConfig, run_replica_bench, summary
    from dgr.errors import DgrError
    from dgr.gguf.synth import SynthSpec, synthesize

    model = synthesize(SynthSpec(n_layer=2, dtype="q8_0"), tmp_path / "synthetic.gguf")
    doc = run_replica_bench(model, ReplicaBenchConfig(concurrency=4, max_tokens=3, repeats=2, lab_name="rb1",
                                                              token_prompts=True))
    assert doc["all_ok"], (doc["one"], doc["two"])
    assert [r["requests_per_route"] for r in doc["two"]] == [[2, 2], [2, 2]]
    assert [r["requests_per_route"] for r in doc["one"]] == [[4], [4]]
    assert len(doc["ratios"]) == 2 and all(r > 0 for r in doc["ratios"])
    assert [r["first"] for r in doc["one"]] == [True, False]     # alternating order
    assert [r["requests"] for r in doc["half"]] == [2, 2]          # half the requests, one replica
    assert len(doc["spread_efficiency"]) == 2 and all(v > 0 for v in doc["spread_efficiency"])
    assert doc["median_batch_ceiling"] > 0
    assert doc["gateway_cpus"] and "load_avg_start" in doc["machine"]
    assert "median two/one" in summary(doc)
    with pytest.raises(DgrError, match="concurrency"):
        ReplicaBenchConfig(concurrency=1).validate()
