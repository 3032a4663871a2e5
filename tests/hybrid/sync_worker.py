"""Rank body of tests/hybrid/test_sync_and_dispatch.py (2 gloo processes).

A tiny HF model is sharded tp 2 under its own names (a stand-in for the Megatron model layer),
synced through the HybridEngine into a fresh hf engine, verified against the source model, and
used to generate through the dispatcher: 2 training TP ranks sharing one DP batch (1 engine
per rank, 2 rollout DP ranks), then 2 DP ranks with different batches sharing one rollout group.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from megarl.hybrid import (DispatchGroups, HybridEngine, RolloutLayout, TrainLayout, WeightSyncMismatch, consecutive_rollout_group,
                           generate_for_training)
from megarl.models.sharding import ShardMeta
from megarl.rollout.base import RolloutRequest, SamplingParams
from megarl.rollout.hf import HFRolloutEngine
from sync_probe import verify_sync

PROMPTS = [[5, 6, 7], [11, 12], [3, 4, 5, 6, 7, 8], [42], [9, 9, 9, 9], [17, 18]]
SAMPLING = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=6, seed=11)
TP_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


def requests(indices, step=4):
    return [RolloutRequest(tuple(PROMPTS[i]), i, step) for i in indices]


def hf_shards(model, tp_rank: int, tp_size: int) -> dict:
    out = {}
    for name, p in model.named_parameters():
        tp_dim = next((d for key, d in TP_DIM.items() if f".{key}." in name), None)
        meta = ShardMeta(tuple(p.shape), tp_dim, tp_rank if tp_dim is not None else 0, tp_size if tp_dim is not None else 1)
        out[name] = (meta.slice_of_full(p.data).clone(), meta)
    return out


def actor_logprobs(model):
    def fn(prompts, responses):
        out = []
        with torch.no_grad():
            for p, r in zip(prompts, responses):
                logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float()
                out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1))
        return out
    return fn


def run(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hybrid = HybridEngine(hf_shards(source, rank, 2), train=TrainLayout(tp=2, pp=1, dp=1), rollout=RolloutLayout(tp=1), bucket_bytes=64 << 10)
    engine = HFRolloutEngine.from_hf_dir(model_dir, max_batch_rows=4)
    stats = hybrid.sync(engine)
    max_diff = verify_sync(engine, PROMPTS[:3], actor_logprobs(source), max_new_tokens=5, atol=1e-4)

    # training tp 2 -> two rollout DP ranks share one DP batch
    tp_results = generate_for_training(engine, requests(range(6)), SAMPLING,
                                       DispatchGroups(mp_group=dist.group.WORLD, mp_rank=rank, mp_size=2, rollout_group=None, rollout_rank=0, rollout_size=1))
    # training dp 2 (different batches) -> one rollout group of 2 consecutive ranks
    mine = [0, 1, 2] if rank == 0 else [3, 4, 5]
    group, ranks, position = consecutive_rollout_group(2)
    assert ranks == [0, 1] and position == rank
    dp_results = generate_for_training(engine, requests(mine), SAMPLING,
                                       DispatchGroups(mp_group=None, mp_rank=0, mp_size=1, rollout_group=group, rollout_rank=position, rollout_size=2))

    # a converter that mis-maps one tensor must be caught
    def corrupt(name, t):
        return [(name, t + 0.5 if name == "model.layers.0.self_attn.q_proj.weight" else t)]

    hybrid.convert = corrupt
    hybrid.sync(engine)
    try:
        verify_sync(engine, PROMPTS[:3], actor_logprobs(source), max_new_tokens=5, atol=1e-4)
        caught = ""
    except WeightSyncMismatch as e:
        caught = str(e)
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump({"max_diff": max_diff, "bytes_received": stats.bytes_received, "caught": caught,
                   "tp": [[r.prompt_index, r.sample_index, r.response_token_ids] for r in tp_results],
                   "dp": [[r.prompt_index, r.sample_index, r.response_token_ids] for r in dp_results]}, f)
    dist.destroy_process_group()
