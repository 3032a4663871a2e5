"""Rank body of tests/hybrid/test_reshard.py: every layout in one 4-process gloo world.

For each case, every rank checks that each tensor it receives equals its rollout slice of the
full tensor, and writes its byte / memory counters for the parent test to check.

Delta sync (`DELTA_CASES`, then `SEPARATE_DELTA_CASES` once the world is split for separate
placement): 20 steps of AdamW on fp32 masters (std 0.02, lr 1e-5, random gradients identical on
every rank), bf16 shards; at every step the delta stream must equal, bit for bit, what a full-mode
engine streams and the bf16 slice of the master, with full syncs every DELTA_FULL_EVERY steps and
after resync_full at DELTA_RESYNC_AT.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from megarl.hybrid.engine import HybridEngine
from megarl.async_rollout.placement import Placement, split_world
from megarl.platform import process_groups
from megarl.hybrid.layout import RolloutLayout, TrainLayout, hybridflow_bytes_per_rank
from naive_allgather import NaiveAllGather  # benchmarks/naive_allgather.py
from synthetic_model import SyntheticModel, full_tensor, synthetic_shards  # benchmarks/synthetic_model.py
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

BF16_DENSE = SyntheticModel(num_layers=2, hidden=64, ffn_hidden=128, vocab=256, dtype=torch.bfloat16)
BF16_MOE = SyntheticModel(num_layers=2, hidden=32, ffn_hidden=32, vocab=64, num_experts=4, dtype=torch.bfloat16, shared_expert=True)
DELTA_STEPS, DELTA_FULL_EVERY, DELTA_RESYNC_AT, DELTA_LR = 20, 8, 12, 1e-5
# (label, model, (tp, pp, dp, ep), rollout tp, grouping, bucket bytes): colocated on all 4 ranks
DELTA_CASES = [
    ("delta dense tp2dp2->1", BF16_DENSE, (2, 1, 2, 1), 1, "micro_dp", 30_000),
    ("delta moe tp2ep2->1", BF16_MOE, (2, 1, 2, 2), 1, "micro_dp", 20_000),
    ("delta moe tp2ep2->2 consecutive", BF16_MOE, (2, 1, 2, 2), 2, "consecutive", 20_000),
]
# separate placement: ranks 0-1 train, ranks 2-3 are two rollout engines of tp 1
SEPARATE_DELTA_CASES = [
    ("delta separate dense tp2->1", BF16_DENSE, (2, 1, 1, 1), 1, 20_000),
    ("delta separate moe tp1ep2->1", BF16_MOE, (1, 1, 2, 2), 1, 20_000),
]


def _adamw_masters(model: SyntheticModel, seed: int):
    """fp32 masters of every tensor (std 0.02, identical on every rank) and their AdamW."""
    masters = {name: (full_tensor(name, shape, torch.float32, seed) * 0.02).requires_grad_()
               for name, shape, *_ in model.tensors()}
    return masters, torch.optim.AdamW(masters.values(), lr=DELTA_LR, weight_decay=0.01)


def _adamw_step(masters, opt, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)  # the same gradients on every rank
    for t in masters.values():
        t.grad = torch.randn(t.shape, generator=g)
    opt.step()


def _bf16_shards(masters, template):
    """This rank's shards of the bf16 rollout copy of the masters (the metadata of `template`)."""
    return {name: (meta.slice_of_full(masters[name].detach().to(torch.bfloat16)).clone(), meta) for name, (_, meta) in template.items()}


def _delta_run(label, model, train, rollout, bucket, rank, expected_of, separate=None) -> dict:
    """DELTA_STEPS syncs of a delta engine beside a full one; every step bitwise equal to it and to
    `expected_of(name, bf16 full tensor)` where this rank loads (None: it loads nothing)."""
    holds = separate is None or not separate.placement.is_rollout(rank)  # separate: rollout ranks hold nothing
    template = synthetic_shards(model, train, rank, seed=7)[0] if holds else {}
    masters, opt = _adamw_masters(model, seed=7)
    local = _bf16_shards(masters, template)
    engines = {mode: HybridEngine(local, train=train, rollout=rollout, bucket_bytes=bucket, separate=separate, mode=mode,
                                  full_every=DELTA_FULL_EVERY) for mode in ("delta", "full")}
    rows = []
    for step in range(DELTA_STEPS):
        if step:
            _adamw_step(masters, opt, step)
        local = _bf16_shards(masters, template)
        if step == DELTA_RESYNC_AT:  # an engine lost its weights: every rank forces the next sync full
            engines["delta"].resync_full()
        full = {name: t.clone() for name, t in engines["full"].stream(local)}
        got = {name: t.clone() for name, t in engines["delta"].stream(local)}
        assert got.keys() == full.keys(), f"{label} step {step}: rank {rank} names differ"
        for name, t in got.items():
            assert t.dtype == torch.bfloat16 and torch.equal(t.view(torch.int16), full[name].view(torch.int16)), \
                f"{label} step {step}: rank {rank}: delta {name} differs from the full sync's"
            if expected_of is not None:
                want = expected_of(engines["delta"], name, masters[name].detach().to(torch.bfloat16))
                assert torch.equal(t.view(torch.int16), want.view(torch.int16)), f"{label} step {step}: rank {rank}: {name} != master"
        d, f = engines["delta"].last_stats, engines["full"].last_stats
        rows.append(dict(full=d.full, bytes=d.bytes_received, full_bytes=d.full_bytes_received, changed=d.changed_fraction,
                         full_mode_bytes=f.bytes_received, copy_bytes=d.copy_bytes, planned_copy_bytes=engines["delta"].delta_copy_bytes(),
                         loaded=len(got)))
    return {"steps": rows}


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

    for label, model, (tp, pp, dp, ep), rollout_tp, grouping, bucket in DELTA_CASES:
        train = TrainLayout(tp, pp, dp, ep)

        def rollout_slice(hybrid, name, full_bf16, rollout_tp=rollout_tp):
            spec = hybrid.plan.specs[name]
            return ShardMeta(spec.full_shape, spec.tp_dim, hybrid.rollout_tp_rank, rollout_tp, spec.sub_chunks).slice_of_full(full_bf16)

        report[label] = _delta_run(label, model, train, RolloutLayout(rollout_tp, grouping), bucket, rank, rollout_slice)

    # separate placement last: splitting the world replaces the training ranks' default group
    world = process_groups.get_default_group()
    separate = split_world(Placement(4, 2, 1))
    for label, model, (tp, pp, dp, ep), rollout_tp, bucket in SEPARATE_DELTA_CASES:
        loads = separate.placement.is_rollout(rank)
        report[label] = _delta_run(label, model, TrainLayout(tp, pp, dp, ep), RolloutLayout(rollout_tp), bucket, rank,
                                   (lambda hybrid, name, full_bf16: full_bf16) if loads else None, separate=separate)
    process_groups.set_default_group(world)
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
