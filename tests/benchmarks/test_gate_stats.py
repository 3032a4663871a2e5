"""The regression gate's statistics and clock on hand-made samples (benchmarks/gate_stats.py,
benchmarks/phase_clock.py): no PPO run here, every expected value worked by hand."""
from __future__ import annotations

import sys
import time
import types

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gate_stats  # noqa: E402
import phase_clock  # noqa: E402


def test_a_load_swing_that_hits_both_sides_of_a_round_does_not_widen_the_paired_interval():
    # Rounds 5-8 ran while the machine was 5x busier; the candidate is 25% slower in every round.
    base = [1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0]
    candidate = [1.25 * b for b in base]
    # medians: base (1 + 5) / 2 = 3, candidate (1.25 + 6.25) / 2 = 3.75 -> 1.25; every resample of rounds
    # keeps the pairs, so every resampled ratio is 1.25 too.
    assert gate_stats.ratio_of_medians(base, candidate) == pytest.approx(1.25)
    lo, hi = gate_stats.paired_bootstrap_interval(base, candidate)
    assert lo == pytest.approx(1.25) and hi == pytest.approx(1.25)
    v = gate_stats.judge("update_actor", base, candidate)
    assert v.gated and v.regressed


def test_each_side_is_compared_at_the_same_position_in_its_rounds():
    # The gate alternates the order, base first in even rounds: the side that runs first ran just before
    # (3 ms, warm), the second ran after the other side's step (9 ms, cold), as the weight sync did on the
    # 2-core machine. The candidate is 25% slower at both positions: 3.75 ms first, 11.25 ms second.
    base_first = [True, False] * 4
    base = [3.0 if first else 9.0 for first in base_first]
    candidate = [3.75 if not first else 11.25 for first in base_first]
    # Paired by round, a warm sample meets a cold one: a resample with more base-first rounds reads
    # 11.25 / 3 = 3.75x, one with more candidate-first rounds 3.75 / 9 = 0.42x, so the interval spans both.
    lo, hi = gate_stats.paired_bootstrap_interval(base, candidate)
    assert lo == pytest.approx(3.75 / 9) and hi == pytest.approx(11.25 / 3)
    assert not gate_stats.judge("sync", base, candidate).regressed
    # At the same position: first 3.75 / 3 and second 11.25 / 9, both 1.25; every resample (within each
    # order) reads 1.25, and the medians are the geometric means sqrt(3 * 9) and sqrt(3.75 * 11.25).
    v = gate_stats.judge("sync", base, candidate, base_first=base_first)
    assert v.ratio == pytest.approx(1.25) and v.interval == pytest.approx((1.25, 1.25)) and v.regressed
    assert v.base_median_s == pytest.approx(27 ** 0.5) and v.candidate_median_s == pytest.approx((3.75 * 11.25) ** 0.5)
    # one order only (or none given): the plain ratio of medians
    assert gate_stats.matched_medians(base, candidate, [True] * 8) == (6.0, 7.5)
    with pytest.raises(ValueError, match="one entry per round"):
        gate_stats.paired_bootstrap_interval(base, candidate, base_first=[True])


def test_noise_widens_the_interval_instead_of_raising_a_false_alarm():
    # The same median slowdown (1.25x), but the candidate's rounds swing from 0.6x to 3x: the rounds'
    # spread cannot tell a slowdown from noise, so the interval reaches below 1 and the phase passes.
    base = [1.0] * 8
    candidate = [0.6, 0.7, 0.8, 1.25, 1.25, 2.0, 2.5, 3.0]
    v = gate_stats.judge("gen", base, candidate)
    assert v.ratio == pytest.approx(1.25)  # median of the candidate: (1.25 + 1.25) / 2
    assert v.interval[0] < 1.0 < v.interval[1] and v.gated and not v.regressed
    # ... and says so: the interval reaches above +10%, so a regression is not ruled out either (the gate then
    # measures more rounds, and reports the phase as inconclusive if it stays so).
    assert v.inconclusive and v.line().split()[:2] == ["inconclusive", "gen"]


def test_a_certain_slowdown_below_the_tolerance_passes_and_one_above_it_fails():
    base = [0.010, 0.011, 0.012, 0.013, 0.014, 0.020]
    slightly = [1.05 * b for b in base]  # certain (interval [1.05, 1.05]) but under the 10% tolerance
    assert not gate_stats.judge("old_log_prob", base, slightly).regressed
    assert not gate_stats.judge("old_log_prob", base, slightly).inconclusive  # certainly under 10%
    assert gate_stats.judge("old_log_prob", base, slightly, tolerance=0.04).regressed
    clean = list(base)
    v = gate_stats.judge("old_log_prob", base, clean)
    assert v.ratio == 1.0 and v.interval == (1.0, 1.0) and not v.regressed


def test_a_phase_shorter_than_the_floor_is_reported_not_gated():
    base = [0.0002] * 5  # 0.2 ms: below the 0.5 ms floor
    v = gate_stats.judge("adv", base, [2 * b for b in base])
    assert v.ratio == pytest.approx(2.0) and not v.gated and not v.regressed
    assert v.line().split()[:3] == ["not", "gated", "adv"]


def test_the_failure_line_names_the_phase_the_slowdown_the_interval_and_the_commits():
    base = [0.040, 0.042, 0.044, 0.046, 0.048]
    candidate = [0.050, 0.0525, 0.055, 0.0575, 0.060]  # 1.25x each
    v = gate_stats.judge("update_actor", base, candidate, base_cpu=[0.04] * 5, candidate_cpu=[0.041] * 5)
    assert v.failure(rounds=5, commits="abc1234567..def7654321", confidence=0.95) == (
        "phase 'update_actor' takes 1.25x its base wall time (+25%; 95% interval 1.25x-1.25x; "
        "median 0.0550 s vs 0.0440 s over 5 paired rounds) in abc1234567..def7654321")
    assert v.line() == ("  REGRESSION  update_actor   wall 0.0550 s vs 0.0440 s   1.25x [1.25, 1.25]"
                        "  cpu 0.0410 s vs 0.0400 s")


def test_unpaired_samples_are_refused():
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        gate_stats.paired_bootstrap_interval([1.0, 2.0], [1.0])


def test_the_clock_counts_a_wait_as_wall_time_and_not_as_cpu_time():
    clock = phase_clock.PhaseClock("cpu")
    token = clock.start()
    time.sleep(0.05)
    waited = clock.stop(token)
    assert waited.wall_s >= 0.05 and waited.cpu_s < 0.02  # a stall: what the old CPU-seconds gate missed
    token = clock.start()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    worked = clock.stop(token)
    assert worked.cpu_s >= 0.05 and worked.wall_s >= worked.cpu_s * 0.99


def test_the_cuda_clock_synchronises_at_the_edges_and_reads_event_time(monkeypatch):
    # No GPU here: a stand-in for torch.cuda records the calls; the event pair reports 250 ms.
    calls = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            calls.append("record")

        def synchronize(self):
            calls.append("event.synchronize")

        def elapsed_time(self, end):
            return 250.0  # milliseconds, as CUDA events report

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, synchronize=lambda: calls.append("synchronize")))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    clock = phase_clock.PhaseClock("cuda")
    t = clock.stop(clock.start())
    assert calls == ["synchronize", "record", "record", "event.synchronize"]
    assert t.wall_s == pytest.approx(0.25)
