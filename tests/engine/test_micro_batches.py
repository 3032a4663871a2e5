"""Micro-batch planning and assembly (megarl.engine.micro_batches), with hand-worked values."""
from __future__ import annotations

import pytest
import torch

from megarl.engine.batch import SequenceBatch
from megarl.engine.micro_batches import balanced_bins, build, plan_packed, plan_padded


def alone(values):  # agree_max of a single DP rank
    return list(values)


def with_other_rank(other):
    """agree_max of two DP ranks, the other one asking for `other` at its i-th call."""
    calls = iter(other)
    return lambda values: [max(v, o) for v, o in zip(values, next(calls))]


def test_balanced_bins_longest_first_into_lightest():
    # 9->b0, 7->b1, 5->b1 (12), 4->b0 (13), 3->b1 (15), 2->b0 (15)
    assert balanced_bins([9, 7, 5, 4, 3, 2], 2) == [[0, 3, 5], [1, 2, 4]]
    assert balanced_bins([3], 3) == [[0], [], []]


def test_packed_plan_uses_fewest_bins_within_budget():
    plan = plan_packed([9, 7, 5, 4, 3, 2], budget=16, agree_max=alone, multiple=8)
    assert plan.packed and plan.bins == [[0, 3, 5], [1, 2, 4]]
    assert plan.width == 16  # loads 15 and 15, rounded up to the multiple
    # One bin of 30 tokens would exceed 16; three would be more micro-batches than needed.
    assert plan_packed([9, 7, 5, 4, 3, 2], budget=30, agree_max=alone).bins == [[0, 1, 2, 3, 4, 5]]


def test_packed_plan_gives_an_oversized_sequence_its_own_micro_batch():
    plan = plan_packed([40, 3, 2], budget=16, agree_max=alone)
    assert plan.bins == [[0], [1, 2]] and plan.width == 40


def test_packed_plan_agrees_with_the_other_dp_ranks():
    # The other rank needs 3 micro-batches and a 20-token row: this rank, which needs one, follows.
    plan = plan_packed([5, 4], budget=16, agree_max=with_other_rank([[3], [3], [20]]))
    assert plan.bins == [[0], [1], [None]]  # a filler row keeps the count equal
    assert plan.width == 20


def test_padded_plan_fills_rows_to_the_budget():
    plan = plan_padded([9, 7, 5], budget=20, agree_max=alone)  # 20 // 9 = 2 rows per micro-batch
    assert not plan.packed and plan.width == 9 and plan.bins == [[0, 1], [2, None]]


def test_padded_plan_has_no_cliff_at_the_budget_boundary():
    # The case: 32 rows of 133 tokens, a 4,096-token budget (30 rows fit). Filling
    # micro-batches to the budget gave 2 x 30 rows (28 filler rows: 28/60 of the slots padding);
    # spreading evenly gives 2 x 16 and no padding at all.
    plan = plan_padded([133] * 32, budget=4096, agree_max=alone)
    assert [len(b) for b in plan.bins] == [16, 16] and None not in sum(plan.bins, [])
    assert plan.padding_fraction([133] * 32) == 0.0
    # 31 rows: 2 x 16, one filler row: 1/32 of the slots.
    assert plan_padded([133] * 31, 4096, alone).padding_fraction([133] * 31) == 1 / 32
    # 30 rows fit exactly in one micro-batch; 61 rows need 3 of 21 (two filler rows, 2/63).
    assert plan_padded([133] * 30, 4096, alone).bins == [list(range(30))]
    plan = plan_padded([133] * 61, 4096, alone)
    assert [len(b) for b in plan.bins] == [21, 21, 21] and plan.padding_fraction([133] * 61) == 2 / 63
    # Ragged rows pad to the longest: [9, 7, 5] -> 2 x 2 rows of 9, 21 real of 36 slots.
    assert plan_padded([9, 7, 5], 20, alone).padding_fraction([9, 7, 5]) == 1 - 21 / 36


def test_packed_plan_padding_fraction():
    # Loads 15 and 15 in rows of 16: 2 of 32 slots are tail padding.
    assert plan_packed([9, 7, 5, 4, 3, 2], 16, alone, multiple=8).padding_fraction([9, 7, 5, 4, 3, 2]) == 2 / 32


def test_padding_fraction_grows_smoothly_with_length():
    # Forward-only sweep over the row length at a fixed budget: the padding never exceeds what
    # the row count forces (fewer filler rows than micro-batches), so there is no step in cost.
    for length in range(100, 400, 7):
        plan = plan_padded([length] * 32, 4096, alone)
        fillers = sum(r is None for b in plan.bins for r in b)
        assert fillers < len(plan.bins)
        assert plan.padding_fraction([length] * 32) == pytest.approx(fillers / (32 + fillers), abs=1e-12)


def _batch():
    seqs = [[11, 12, 13, 14], [21, 22, 23]]  # prompts [11, 12] and [21]; responses of 2 tokens
    return SequenceBatch(seqs, [2, 1], [0, 1], 2, {"response_mask": torch.ones(2, 2), "adv": torch.tensor([[1.0, 2.0], [3.0, 4.0]])})


def test_packed_micro_batch_tensors():
    batch = _batch()
    plan = plan_packed([4, 3], budget=64, agree_max=alone, multiple=8)
    [mb] = build(plan, batch, rows=[0, 1], fields=("adv",), device=torch.device("cpu"))
    assert mb["input_ids"].tolist() == [[11, 12, 13, 14, 21, 22, 23, 0]]
    params = mb["packed_seq_params"]
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 4, 7, 8]  # tail pad: own segment
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == params.max_seqlen_kv == 4
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    # Output at p predicts token p+1: 12->13, 13->14 in the first sequence, 21->22, 22->23 in the second.
    assert mb["positions"].tolist() == [[1, 2], [4, 5]]
    assert mb["input_ids"][0][mb["positions"] + 1].tolist() == [[13, 14], [22, 23]]
    assert mb["rows"] == [0, 1] and mb["adv"].tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_padded_micro_batch_tensors_address_the_flattened_rows():
    batch = _batch()
    plan = plan_padded([4, 3], budget=64, agree_max=alone)
    [mb] = build(plan, batch, rows=[0, 1], fields=(), device=torch.device("cpu"))
    assert mb["input_ids"].tolist() == [[11, 12, 13, 14], [21, 22, 23, 0]]
    assert "packed_seq_params" not in mb
    assert mb["positions"].tolist() == [[1, 2], [4, 5]]  # row 1 starts at 4 in the flattened [2 * 4]
    assert mb["input_ids"].reshape(-1)[mb["positions"] + 1].tolist() == [[13, 14], [22, 23]]


def test_positions_past_a_short_response_stay_inside_their_sequence():
    batch = SequenceBatch([[1, 2, 3], [4, 5, 6, 7, 8]], [2, 2], [0, 1], 3, {"response_mask": torch.tensor([[1.0, 0, 0], [1, 1, 1]])})
    [mb] = build(plan_packed([3, 5], 64, alone), batch, rows=[0, 1], fields=(), device=torch.device("cpu"))
    # Sequence 0 has one response token; its other slots clamp to its own last predicting position.
    assert mb["positions"].tolist() == [[1, 1, 1], [4, 5, 6]]


def test_tail_padding_segments_are_no_longer_than_the_longest_sequence():
    # Agreed width 20 (another DP rank's row), 7 tokens here: 13 pad tokens become 4 + 4 + 4 + 1.
    batch = SequenceBatch([[1, 2, 3, 4], [5, 6, 7]], [2, 1], [0, 1], 2, {"response_mask": torch.ones(2, 2)})
    plan = plan_packed([4, 3], budget=64, agree_max=with_other_rank([[1], [1], [20]]))
    [mb] = build(plan, batch, rows=[0, 1], fields=(), device=torch.device("cpu"))
    assert mb["packed_seq_params"].cu_seqlens_q.tolist() == [0, 4, 7, 11, 15, 19, 20]
    assert mb["packed_seq_params"].max_seqlen_q == 4
