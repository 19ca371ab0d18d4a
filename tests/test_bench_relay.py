"""`dgr bench relay` end to end on a tiny synthetic model (labelled synthetic: the figures say
nothing about speed): two lab hosts, the same workers chained directly and chained through
relay bridges and an egress, one ratio per repeat."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.native]


def test_relay_bench_keeps_the_relayed_route_chained(tmp_path, lab_worker):
    from dgr.bench.relay import RelayBenchConfig, run_relay_bench, summary
    from dgr.errors import DgrError
    from dgr.gguf.synth import SynthSpec, synthesize

    model = synthesize(SynthSpec(n_layer=4, dtype="q8_0"), tmp_path / "synthetic.gguf")
    doc = run_relay_bench(model, RelayBenchConfig(sessions=3, max_tokens=4, repeats=2, stepwise_lane=True,
                                                  lab_name="rl1", token_prompts=True))
    assert doc["all_ok"], doc["lanes"]
    lanes = doc["lanes"]
    assert [r["mode"] for r in lanes["direct"]] == ["chained"] * 2
    assert [r["mode"] for r in lanes["relay"]] == ["chained"] * 2     # through the egress, not stepwise
    assert [r["mode"] for r in lanes["relay_all"]] == ["chained"] * 2
    assert [r["mode"] for r in lanes["stepwise"]] == ["stepwise"] * 2
    assert all(r["tokens"] == 12 for lane in lanes.values() for r in lane)
    # the relayed lanes went through the bridges (the relay lane's driver dials the head directly);
    # the direct one did not
    assert all("relay+tcp://" in str(r["route"]) for r in lanes["relay"] + lanes["relay_all"] + lanes["stepwise"])
    assert all("relay+tcp://" not in str(r["route"][0]) for r in lanes["relay"])
    assert all("relay+tcp://" in str(r["route"][0]) for r in lanes["relay_all"])
    assert not any("relay+tcp://" in str(r["route"]) for r in lanes["direct"])
    assert all(r["relay_cpu_s"] >= 0 for lane in lanes.values() for r in lane)
    assert [r["first"] for r in lanes["direct"]] == [True, False]     # alternating order
    assert len(doc["ratios"]) == 2 and all(r > 0 for r in doc["ratios"] + doc["ratios_all_relayed"])
    assert doc["driver_cpus"] and "load_avg_start" in doc["machine"]
    assert [p["relay_egress"] for p in doc["placement"]][0] is None and doc["placement"][1]["relay_egress"]
    assert "median relay/direct" in summary(doc)
    with pytest.raises(DgrError, match="sessions"):
        RelayBenchConfig(sessions=0).validate()
    with pytest.raises(DgrError, match="two ranges"):
        RelayBenchConfig(split=((0, 4),)).validate()
