"""DGR-012's pure helpers (cli/dgr/accept/stories/dgr012.py): the concurrency levels, the
saturation knee, the flood's gaps and the starvation bound. No model, no worker."""

from __future__ import annotations

import pytest

from dgr.accept.stories.dgr012 import (BATCH_COUNTERS, flood_gaps, full_batch_s, gap_bound, knee, levels_up_to,
                                       percentile)


def test_levels_double_up_to_the_admitted_maximum():
    assert levels_up_to(64) == [1, 2, 4, 8, 16, 32, 64]
    assert levels_up_to(48) == [1, 2, 4, 8, 16, 32, 48]
    assert levels_up_to(1) == [1]


def test_knee_is_the_first_level_whose_successor_adds_less_than_5_percent():
    assert knee({1: 78.0, 2: 97.0, 4: 119.0, 8: 131.0}) is None          # still +10 % at 8: no knee
    assert knee({1: 78.0, 2: 97.0, 4: 119.0, 8: 131.0, 16: 135.0}) == 8  # +3 % from 8 to 16
    assert knee({1: 100.0, 2: 104.9}) == 1
    assert knee({1: 100.0, 2: 105.0}) is None                            # exactly 5 % still gains
    assert knee({1: 100.0, 2: 150.0, 4: 90.0, 8: 200.0}) == 2            # a drop is past the knee
    assert knee({1: 100.0}) is None
    assert knee({1: 100.0, 2: 108.0}, min_gain=0.10) == 1


def test_flood_gaps_are_those_overlapping_the_window():
    times = [0.0, 0.1, 0.2, 1.5, 2.0, 2.1, 2.2]
    # 0.2 -> 1.5 begins before the flood (1.0 .. 2.05) and ends in it; 2.0 -> 2.1 ends after it
    assert flood_gaps(times, 1.0, 2.05) == pytest.approx([1.3, 0.5, 0.1])
    assert flood_gaps(times, 5.0, 6.0) == []
    assert flood_gaps([], 0.0, 1.0) == []


def test_percentile_nearest_rank():
    assert percentile([], 99) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0
    assert percentile(list(range(1, 201)), 99) == 198


def test_full_batch_time_from_the_prefill_batches_a_worker_timed():
    before = {k: 0.0 for k in BATCH_COUNTERS}
    after = dict(before, dgr_decode_busy_seconds_total=10.5, dgr_decode_only_busy_seconds_total=0.5,
                 dgr_batches_total=10, dgr_decode_only_batches_total=6, dgr_batch_rows_total=1006,
                 dgr_decode_only_rows_total=6)
    # 10 s over 1000 rows in batches that carried prefill: 10 ms a row, 512 rows a full batch
    assert full_batch_s(before, after, 512) == pytest.approx(5.12)
    assert full_batch_s(before, before, 512) == 0.0


def test_gap_bound_is_the_undisturbed_gap_plus_one_batch_per_shard_plus_the_margin():
    assert gap_bound(0.02, [1.0, 1.5], margin_s=0.2) == pytest.approx(2.72)
