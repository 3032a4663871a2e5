"""Separate placement's weight stream: the colocated reshard plan with the rollout ranks as its
only receivers. Hand-worked bytes: a rollout rank holds nothing, so it receives exactly its
rollout shard (the M-to-N bound for two disjoint groups) and the training ranks receive nothing."""
from __future__ import annotations

import pytest

from megarl.hybrid.plan import Span, build_specs, make_plan
from megarl.layout import ParallelLayout, separate_assignment

# "w": [4, 6] float32 split over tp on dim 0 (96 bytes, 48 per tp shard); "n": [6] replicated (24 bytes)
MODEL_BYTES = 96 + 24


def _meta(tp_rank: int, tp: int) -> list[tuple]:
    return [("w", (4, 6), "torch.float32", 0, tp_rank, tp, 1, (4 // tp, 6)),
            ("n", (6,), "torch.float32", None, 0, 1, 1, (6,))]


@pytest.mark.parametrize("train_tp,rollout_ranks,rollout_tp,shard_bytes", [
    (2, (2,), 1, MODEL_BYTES),              # tp2 -> one rollout rank: the whole model
    (2, (2, 3), 2, 48 + 24),                # tp2 -> rollout tp2: half of w, all of n, each
    (1, (1, 2), 1, MODEL_BYTES),            # one trainer -> two rollout replicas: the whole model each
    (2, (2, 3, 4, 5), 2, 48 + 24),          # two rollout tp2 instances
])
def test_each_rollout_rank_receives_exactly_its_shard(train_tp, rollout_ranks, rollout_tp, shard_bytes):
    train = ParallelLayout.for_world(train_tp, tp=train_tp)
    per_rank = [_meta(r, train_tp) for r in range(train_tp)] + [[] for _ in rollout_ranks]
    assignment = separate_assignment(train_tp, rollout_ranks, rollout_tp)
    plan = make_plan(build_specs(per_rank), train, assignment, rollout_tp, bucket_bytes=1 << 20, receivers=rollout_ranks)
    for r in range(train_tp):
        assert plan.needed_bytes[r] == plan.planned_recv_bytes[r] == 0 and not plan.receives(r)
    for r in rollout_ranks:
        assert plan.needed_bytes[r] == plan.planned_recv_bytes[r] == plan.min_recv_bytes[r] == shard_bytes
    ops = [op for b in plan.buckets for op in b.ops]
    assert ops and all(op.kind == "p2p" and op.src < train_tp and set(op.dsts) <= set(rollout_ranks) for op in ops)
    # the rollout tp rank decides the half of "w": rank q of an instance gets rows [2q, 2q+2)
    if rollout_tp == 2:
        assert [plan.needed_span(r, "w") for r in rollout_ranks[:2]] == [Span(0, 1), Span(1, 2)]


def test_sources_share_the_load():
    # two rollout replicas of a tp2 trainer: each half of "w" is sent by the rank that holds it
    train = ParallelLayout.for_world(2, tp=2)
    plan = make_plan(build_specs([_meta(0, 2), _meta(1, 2), [], []]), train, separate_assignment(2, (2, 3), 1), 1,
                     bucket_bytes=1 << 20, receivers=(2, 3))
    sent = {0: 0, 1: 0}
    for b in plan.buckets:
        for chunk, src, dsts in b.transfers:
            sent[src] += chunk.nbytes * len(dsts)
    assert sent[0] + sent[1] == 2 * MODEL_BYTES and abs(sent[0] - sent[1]) <= 24 * 2


def test_assignment_refuses_rollout_ranks_among_the_trainers():
    with pytest.raises(ValueError, match="must follow"):
        separate_assignment(2, (1, 2), 1)
    with pytest.raises(ValueError, match="does not divide"):
        separate_assignment(2, (2, 3, 4), 2)


def test_only_the_first_rank_of_a_rollout_engine_serves():
    """rollout tp2: vLLM's TP ranks run in lockstep, so clients talk to each engine's first rank."""
    from megarl.async_rollout.placement import Placement

    two_engines = Placement(world_size=6, train_size=2, rollout_tp=2)  # engines on ranks 2-3 and 4-5
    assert [two_engines.server_of(t) for t in (0, 1)] == [2, 4]
    assert [two_engines.clients_of(r) for r in (2, 3, 4, 5)] == [(0,), (), (1,), ()]
    assert [Placement(5, 2).server_of(t) for t in (0, 1)] == [2, 3]  # tp1: round-robin over all rollout ranks
