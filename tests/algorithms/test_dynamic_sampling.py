"""DAPO dynamic sampling (megarl.step.dynamic_sampling.generate_filtered) on a fake engine and reward:
which groups are trained, in which order, on which DP rank, and the error after the last round.
DP ranks are threads whose `gather` meets at a barrier (the trainer's is an all_gather_object
over the DP group); the multi-process run is tests/trainer/test_dynamic_sampling_run.py."""
from __future__ import annotations

import threading

import pytest

from megarl.data.dataset import PromptRow
from megarl.step.dynamic_sampling import NotEnoughGroups, generate_filtered, has_spread
from megarl.step.samples import Sample

P, N = 4, 3  # prompts per step, samples per prompt


class FakeData:
    """Step s's global batch is dataset rows 100*s .. 100*s + P - 1; a rank takes its block."""

    def __init__(self, dp_rank: int, dp_size: int):
        self.dp_rank, self.dp_size, self.step = dp_rank, dp_size, 0

    def next_step(self) -> list[PromptRow]:
        per = P // self.dp_size
        rows = [PromptRow(global_index=g, row=100 * self.step + g, prompt=f"p{100 * self.step + g}", ground_truth="",
                          data_source="") for g in range(self.dp_rank * per, (self.dp_rank + 1) * per)]
        self.step += 1
        return rows


def fake_generate(prompts: list[PromptRow]) -> list[Sample]:
    """N samples per prompt; the text records the (global index, sample) seed the engine would use."""
    return [Sample(p, i, [7], [0.0], True, f"{p.global_index}/{i}") for p in prompts for i in range(N)]


def score_rows(spread_rows: set[int]):
    """Scores that differ within a group only for the dataset rows in spread_rows."""
    return lambda samples: [float(s.sample_index) if s.prompt.row in spread_rows else 1.0 for s in samples]


def run_ranks(dp_size: int, spread_rows: set[int], max_rounds: int = 5):
    barrier, slots = threading.Barrier(dp_size), [None] * dp_size
    results, errors = [None] * dp_size, [None] * dp_size

    def rank(r: int):
        def gather(obj):
            slots[r] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        try:
            results[r] = generate_filtered(FakeData(r, dp_size).next_step, fake_generate, score_rows(spread_rows), gather,
                                           prompts_per_step=P, samples_per_prompt=N, max_rounds=max_rounds,
                                           dp_rank=r, dp_size=dp_size)
        except NotEnoughGroups as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(dp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results, errors


# rows with a spread: round 0 has 1 and 3; round 1 (rows 100..103) has 100; round 2 has 201 and 202
SPREAD = {1, 3, 100, 201, 202}


def test_keeps_groups_with_spread_in_global_order_and_renumbers_them():
    (out,), _ = run_ranks(1, SPREAD)
    # rounds 0, 1, 2 give 2 + 1 + 2 = 5 groups with a spread; the first 4 are trained
    assert [s.prompt.row for s in out.samples[::N]] == [1, 3, 100, 201]
    assert [s.prompt.global_index for s in out.samples] == [g for g in range(P) for _ in range(N)]
    # sampling identity: round k, prompt g was generated as global index k * P + g
    assert [s.text for s in out.samples[::N]] == ["1/0", "3/0", "4/0", "9/0"]
    assert out.scores == [0.0, 1.0, 2.0] * P
    assert all(has_spread(out.scores[i:i + N]) for i in range(0, len(out.scores), N))
    assert out.metrics == {"train/num_gen_batches": 3.0, "train/num_groups_kept": 4.0,
                           "train/num_groups_dropped": 7.0, "train/num_groups_unused": 1.0}


@pytest.mark.parametrize("dp_size", [2, 4])
def test_every_dp_split_trains_what_one_process_trains(dp_size):
    (single,), _ = run_ranks(1, SPREAD)
    parts, errors = run_ranks(dp_size, SPREAD)
    assert errors == [None] * dp_size
    # rank r holds block r of the one-process batch: same groups, same order, same scores
    assert [s for part in parts for s in part.samples] == single.samples
    assert [x for part in parts for x in part.scores] == single.scores
    assert all(part.metrics == single.metrics for part in parts)


def test_one_round_suffices_when_every_group_has_spread():
    (out,), _ = run_ranks(1, {0, 1, 2, 3})
    assert out.metrics["train/num_gen_batches"] == 1.0 and out.metrics["train/num_groups_dropped"] == 0.0
    assert [s.prompt.row for s in out.samples[::N]] == [0, 1, 2, 3]


def test_too_few_groups_after_the_last_round_is_one_clear_error():
    _, errors = run_ranks(2, {1, 100}, max_rounds=3)
    assert all(isinstance(e, NotEnoughGroups) for e in errors)  # every rank raises, none hangs
    assert str(errors[0]) == str(errors[1]) == (
        "dynamic sampling: 3 generation rounds of 4 prompts gave 2 groups whose samples do not all score the same, "
        "fewer than data.prompts_per_step = 4; raise algorithm.filter_groups.max_num_gen_batches (now 3), or check "
        "that the reward can tell this policy's responses apart")
