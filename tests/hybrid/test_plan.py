"""Layouts and the reshard plan, without processes: placement, bytes against the bound, buckets."""
from __future__ import annotations

import pytest

from megarl.hybrid.engine import shard_metadata
from megarl.hybrid.layout import RolloutLayout, TrainLayout, assign_rollout, hybridflow_bytes_per_rank
from megarl.hybrid.plan import build_specs, make_plan
from synthetic_model import SyntheticModel, synthetic_shards  # benchmarks/synthetic_model.py

MODEL = SyntheticModel(num_layers=4, hidden=64, ffn_hidden=128, vocab=256)


def _plan(train: TrainLayout, rollout: RolloutLayout, bucket_bytes: int = 1 << 20, model: SyntheticModel = MODEL):
    metas = [shard_metadata(synthetic_shards(model, train, r)[0]) for r in range(train.world_size)]
    return make_plan(build_specs(metas), train, assign_rollout(train, rollout), rollout.tp, bucket_bytes)


def test_megatron_rank_order():
    layout = TrainLayout(tp=2, pp=2, dp=2)
    # rank = tp + tp * (dp + dp_size * pp): rank 5 = 1 + 2 * (0 + 2 * 1)
    c = layout.coords(5)
    assert (c.tp, c.dp, c.pp) == (1, 0, 1)
    assert all(layout.rank_of(*(lambda c: (c.pp, c.tp, c.dp))(layout.coords(r))) == r for r in range(8))
    assert layout.model_parallel_ranks(dp=1) == [2, 3, 6, 7]
    with pytest.raises(ValueError, match=r"3 ranks per pipeline stage is not divisible by etp\*ep = 1\*2 = 2"):
        TrainLayout(tp=1, pp=1, dp=3, ep=2)


def test_micro_dp_groups_make_training_shards_subsets_of_rollout_shards():
    # HybridFlow Fig. 8: t = 4, t_g = 2 -> rollout groups {0, 2}, {1, 3}; q = j // 2
    a = assign_rollout(TrainLayout(tp=4, pp=1, dp=1), RolloutLayout(tp=2))
    assert a.rollout_groups == ((0, 2), (1, 3))
    assert a.rollout_tp_rank == (0, 0, 1, 1)
    assert a.micro_dp_groups == ((0, 1), (2, 3))
    c = assign_rollout(TrainLayout(tp=4, pp=1, dp=1), RolloutLayout(tp=2, grouping="consecutive"))
    assert c.rollout_groups == ((0, 1), (2, 3)) and c.rollout_tp_rank == (0, 1, 0, 1)


def test_hybridflow_formula_hand_worked():
    # (t p - t_g) / (t_g t p) M: t = 4, p = 1, t_g = 2, M = 96 -> 2 / 8 * 96 = 24
    assert hybridflow_bytes_per_rank(96, TrainLayout(4, 1, 1), 2) == 24
    # t = 2, p = 2, t_g = 1 -> 3 / 4 * 96 = 72
    assert hybridflow_bytes_per_rank(96, TrainLayout(2, 2, 1), 1) == 72


@pytest.mark.parametrize("tp,pp,dp,rollout_tp", [(4, 1, 1, 1), (4, 1, 1, 2), (2, 2, 1, 1), (2, 1, 2, 1), (2, 2, 1, 2)])
def test_micro_dp_plan_receives_exactly_the_minimum(tp, pp, dp, rollout_tp):
    plan = _plan(TrainLayout(tp, pp, dp), RolloutLayout(rollout_tp))
    assert plan.planned_recv_bytes == plan.min_recv_bytes
    bound = hybridflow_bytes_per_rank(plan.model_bytes, TrainLayout(tp, pp, dp), rollout_tp)
    assert max(plan.planned_recv_bytes) <= 1.05 * bound  # replicated norms make it differ slightly


def test_pure_tp_becomes_one_all_gather_per_bucket():
    plan = _plan(TrainLayout(4, 1, 1), RolloutLayout(2))
    assert {op.kind for b in plan.buckets for op in b.ops} == {"all_gather"}


def test_consecutive_groups_cost_more_when_rollout_tp_is_between():
    # t = 4 -> t_g = 2 with vLLM-style consecutive groups: rank 1 (slice 1) must fetch slices 2 and 3
    micro = _plan(TrainLayout(4, 1, 1), RolloutLayout(2))
    consecutive = _plan(TrainLayout(4, 1, 1), RolloutLayout(2, grouping="consecutive"))
    assert consecutive.planned_recv_bytes == consecutive.min_recv_bytes
    assert max(consecutive.planned_recv_bytes) == 2 * max(micro.planned_recv_bytes)


def test_buckets_respect_the_size_and_split_oversized_tensors():
    bucket = 20_000  # the 256 x 64 fp32 embedding (64 KiB) must be cut into row parts
    plan = _plan(TrainLayout(4, 1, 1), RolloutLayout(1), bucket_bytes=bucket)
    for b in plan.buckets:
        for r in range(4):
            assert sum(op.buffer_bytes(r) for op in b.ops) <= bucket
    parts = [e for b in plan.buckets for e in b.entries if e.name == "embedding.word_embeddings.weight"]
    assert len(parts) > 1 and [e.last for e in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[0].rows[0] == 0 and parts[-1].rows[1] == 64  # cut along dim 1 (dim 0 is the TP dim)
    assert plan.planned_recv_bytes == plan.min_recv_bytes


def test_expert_parallel_plan_fetches_experts_from_other_replicas():
    moe = SyntheticModel(num_layers=2, hidden=32, ffn_hidden=32, vocab=64, num_experts=4)
    plan = _plan(TrainLayout(2, 1, 2, ep=2), RolloutLayout(1), model=moe)
    assert plan.planned_recv_bytes == plan.min_recv_bytes
    expert = plan.specs["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert {h for h, _ in expert.holders} == {2, 3}  # ep rank 1 = dp rank 1 holds experts 2 and 3


def test_metadata_errors_are_actionable():
    train = TrainLayout(2, 1, 1)
    metas = [shard_metadata(synthetic_shards(MODEL, train, r)[0]) for r in range(2)]
    with pytest.raises(ValueError, match=r"no rank holds TP shard\(s\) \[1\]"):
        build_specs([metas[0], []])
    bad = [list(metas[0]), list(metas[1])]
    name, full, dtype, tp_dim, tp_rank, tp_size, sub, local = bad[1][1]
    bad[1][1] = (name, full, "torch.float16", tp_dim, tp_rank, tp_size, sub, local)
    with pytest.raises(ValueError, match="another rank"):
        build_specs(bad)
    odd = SyntheticModel(num_layers=1, hidden=6, ffn_hidden=6, vocab=6)  # qkv has 18 rows: not 4 units
    train = TrainLayout(2, 1, 2)
    metas = [shard_metadata(synthetic_shards(odd, train, r)[0]) for r in range(4)]
    with pytest.raises(ValueError, match=r"not divisible into lcm\(train tp 2, rollout tp 4\) = 4 units"):
        make_plan(build_specs(metas), train, assign_rollout(train, RolloutLayout(4)), 4, 1 << 20)


def test_engine_rows_move_only_the_rows_between_the_two_boundaries():
    # vLLM splits the (padded) vocabulary at its own boundary: 256 rows, engine rank 0 needs rows
    # 0-159, rank 1 rows 160-249 (250 real rows); training tp2 splits at row 128. Rank 0 receives
    # rows 128-159 of both vocabulary tensors (32 x 64 fp32 = 8 KiB each), rank 1 nothing more.
    train, rows = TrainLayout(2, 1, 1), ((0, 160), (160, 250))
    metas = [shard_metadata(synthetic_shards(MODEL, train, r)[0]) for r in range(2)]
    vocab = {"embedding.word_embeddings.weight": rows, "output_layer.weight": rows}
    assignment = assign_rollout(train, RolloutLayout(2, grouping="consecutive"))
    plan = make_plan(build_specs(metas), train, assignment, 2, 1 << 20, vocab)
    even = make_plan(build_specs(metas), train, assignment, 2, 1 << 20)
    assert even.min_recv_bytes == [0, 0]  # the trainer's own split: nothing moves
    assert plan.min_recv_bytes == [2 * 32 * 64 * 4, 0] and plan.planned_recv_bytes == plan.min_recv_bytes
    assert plan.needed_bytes[0] - even.needed_bytes[0] == 2 * (160 - 128) * 64 * 4  # 160 rows instead of 128
    assert plan.needed_bytes[1] - even.needed_bytes[1] == 2 * (90 - 128) * 64 * 4  # 90 rows instead of 128
    with pytest.raises(ValueError, match="one row range per rollout rank"):
        make_plan(build_specs(metas), train, assignment, 2, 1 << 20, {"decoder.final_layernorm.weight": rows})


@pytest.mark.parametrize("tp,pp,dp,ep,rollout_tp", [(2, 1, 2, 2, 2), (1, 1, 4, 4, 2), (1, 2, 2, 2, 2), (1, 1, 4, 2, 4)])
def test_vllm_rank_order_under_expert_parallelism(tp, pp, dp, ep, rollout_tp):
    # The groups vLLM and SGLang form (consecutive ranks, TP rank r % tp) over MoE layouts with ep:
    # every rank plans to receive exactly its rollout shard minus what it holds, experts included.
    moe = SyntheticModel(num_layers=2, hidden=32, ffn_hidden=32, vocab=64, num_experts=4)
    train = TrainLayout(tp, pp, dp, ep)
    a = assign_rollout(train, RolloutLayout(rollout_tp, grouping="consecutive"))
    assert a.rollout_tp_rank == tuple(r % rollout_tp for r in range(4))
    assert a.rollout_groups == tuple(tuple(range(s, s + rollout_tp)) for s in range(0, 4, rollout_tp))
    plan = _plan(train, RolloutLayout(rollout_tp, grouping="consecutive"), model=moe)
    assert plan.planned_recv_bytes == plan.min_recv_bytes
    # each rank needs 1/rollout_tp of every split tensor and all replicated ones: the same on every rank
    assert len(set(plan.needed_bytes)) == 1 and plan.needed_bytes[0] < plan.model_bytes
