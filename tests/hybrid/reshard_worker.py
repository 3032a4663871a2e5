"""Rank body of tests/hybrid/test_reshard.py: every layout in one 4-process gloo world.

For each case, every rank checks that each tensor it receives equals its rollout slice of the
full tensor, and writes its byte / memory counters for the parent test to check.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from megarl.hybrid.engine import HybridEngine
from megarl.hybrid.layout import RolloutLayout, TrainLayout, hybridflow_bytes_per_rank
from naive_allgather import NaiveAllGather  # benchmarks/naive_allgather.py
from synthetic_model import SyntheticModel, synthetic_shards  # benchmarks/synthetic_model.py
from megarl.models.sharding import ShardMeta

DENSE = SyntheticModel(num_layers=4, hidden=64, ffn_hidden=128, vocab=256)
MOE = SyntheticModel(num_layers=2, hidden=32, ffn_hidden=32, vocab=64, num_experts=4)

# (label, model, (tp, pp, dp, ep), rollout tp, grouping, bucket bytes)
CASES = [
    ("tp4->1", DENSE, (4, 1, 1, 1), 1, "micro_dp", 100_000),
    ("tp4->1 all_gather_single (the NCCL path)", DENSE, (4, 1, 1, 1), 1, "micro_dp", 100_000),
    ("tp4->2", DENSE, (4, 1, 1, 1), 2, "micro_dp", 100_000),
    ("tp2pp2->1", DENSE, (2, 2, 1, 1), 1, "micro_dp", 100_000),
    ("tp2dp2->1", DENSE, (2, 1, 2, 1), 1, "micro_dp", 100_000),
    ("tp2pp2->2 small buckets", DENSE, (2, 2, 1, 1), 2, "micro_dp", 12_000),
    ("tp4->2 consecutive", DENSE, (4, 1, 1, 1), 2, "consecutive", 30_000),
    ("moe tp2ep2->1", MOE, (2, 1, 2, 2), 1, "micro_dp", 20_000),
    ("moe tp1ep4->2", MOE, (1, 1, 4, 4), 2, "micro_dp", 20_000),
    # what vLLM and SGLang impose: rollout TP groups of consecutive ranks (r % tp), on 4 processes
    ("tp2pp2->2 consecutive", DENSE, (2, 2, 1, 1), 2, "consecutive", 30_000),
    ("tp1dp4->2 consecutive", DENSE, (1, 1, 4, 1), 2, "consecutive", 30_000),
    ("moe tp2ep2->2 consecutive", MOE, (2, 1, 2, 2), 2, "consecutive", 20_000),
    ("moe tp1ep2pp2->2 consecutive", MOE, (1, 2, 2, 2), 2, "consecutive", 20_000),
    ("moe tp1ep4->4 consecutive", MOE, (1, 1, 4, 4), 4, "consecutive", 20_000),
    # vLLM's padded vocabulary (megarl.rollout.vllm_direct): rank q needs rows the even split does not give
    ("tp4->2 consecutive, vLLM vocab rows", DENSE, (4, 1, 1, 1), 2, "consecutive", 30_000),
]
# rows of the vocabulary tensors per rollout rank where the engine splits them its own way:
# 250 real rows of 256, vLLM-style boundary at 160 (its padded vocabulary / 2) instead of 128
VOCAB_ROWS = {"tp4->2 consecutive, vLLM vocab rows": ((0, 160), (160, 250))}


def run(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    report = {}
    for label, model, (tp, pp, dp, ep), rollout_tp, grouping, bucket in CASES:
        train = TrainLayout(tp, pp, dp, ep)
        local, full = synthetic_shards(model, train, rank, seed=len(label), keep_full=True)
        rows = VOCAB_ROWS.get(label)
        vocab_rows = {n: rows for n in ("embedding.word_embeddings.weight", "output_layer.weight")} if rows else {}
        hybrid = HybridEngine(local, train=train, rollout=RolloutLayout(rollout_tp, grouping, rows=tuple(vocab_rows.items())),
                              bucket_bytes=bucket)
        if "all_gather_single" in label:  # gloo runs all-gathers as broadcasts by default
            hybrid._runner.all_gather_as_broadcasts = False
        q, seen = hybrid.rollout_tp_rank, []
        for name, tensor in hybrid.stream():
            spec = hybrid.plan.specs[name]
            if name in vocab_rows:
                expected = full[name][slice(*vocab_rows[name][q])]
            else:
                expected = ShardMeta(spec.full_shape, spec.tp_dim, q, rollout_tp, spec.sub_chunks).slice_of_full(full[name])
            assert torch.equal(tensor, expected), f"{label}: rank {rank} got a wrong {name}"
            seen.append(name)
        assert sorted(seen) == sorted(full), f"{label}: rank {rank} missed {set(full) - set(seen)}"
        s = hybrid.last_stats
        if grouping == "consecutive":  # vLLM's TP rank order: blocks of rollout_tp consecutive ranks
            assert q == rank % rollout_tp and hybrid.rollout_group_ranks == tuple(range(rank - q, rank - q + rollout_tp))
        report[label] = dict(bytes_received=s.bytes_received, exact_min=hybrid.plan.min_recv_bytes[rank],
                             hybridflow=hybridflow_bytes_per_rank(model.nbytes, train, rollout_tp), peak=s.peak_extra_bytes,
                             bucket=bucket, largest=hybrid.plan.largest_tensor_bytes)
        if ep == 1:  # the baseline gives every rank every full tensor
            naive = NaiveAllGather(local, train=train)
            for name, tensor in naive.stream():
                assert torch.equal(tensor, full[name]), f"{label}: naive baseline got a wrong {name}"
            report[label]["naive_bytes_received"] = naive.last_stats.bytes_received
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
