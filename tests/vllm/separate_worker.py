"""Run under torchrun by test_separate_placement.py (in .venv-vllm): rollout.placement=separate with
real vLLM. Ranks 0-1 train (a Megatron actor at train tp2), the others are rollout ranks that run
exactly what a rollout rank of `launch/ppo.py` runs (megarl.async_rollout.server.make_server: the
vLLM engine built over the rollout ranks alone, the shared reshard plan, the server loop). The
actor's weights are perturbed (so vLLM's dummy weights are replaced by weights nobody else has),
streamed through the HybridEngine to the rollout ranks as the trainer streams them (RemoteRollout),
and the training ranks ask their server for greedy responses. Each rank writes what it saw to
--tmp/rank<N>.json: a rollout rank its bytes received in the sync, its rollout shard per the plan,
the bytes of vLLM's own parameters on it; training rank 0 the responses and the exported actor.
"""
from __future__ import annotations

import argparse
import json
import os
import zlib

import torch
import torch.distributed as dist

from megarl.config import load_config
from megarl.async_rollout.placement import Placement, split_world
from megarl.rollout.base import RolloutRequest, SamplingParams
from sync_worker import PROMPTS, vllm_shard_bytes  # this directory: the colocated sync worker's prompts and bound

GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
TRAIN_SIZE = 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rollout-tp", type=int, required=True)
    p.add_argument("--tmp", required=True)
    args = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    cfg = load_config("configs/tiny_cpu_vllm.yaml", [
        f"model.path={args.model}", "model.make_tiny.enable=false", "parallel.tp=2", "rollout.placement=separate",
        f"rollout.num_ranks={world - TRAIN_SIZE}", f"rollout.tp={args.rollout_tp}", "rollout.max_new_tokens=8",
        "rollout.bucket_bytes=65536", "data.max_prompt_tokens=16"])
    dist.init_process_group("gloo")
    groups = split_world(Placement(world, TRAIN_SIZE, args.rollout_tp))
    rank = dist.get_rank(group=groups.world)
    if groups.placement.is_rollout(rank):
        _rollout_rank(cfg, groups, rank, args.tmp)
    else:
        _training_rank(cfg, groups, rank, args)


def _rollout_rank(cfg, groups, rank: int, tmp: str) -> None:
    from megarl.async_rollout.server import make_server

    server = make_server(cfg, groups, rank)
    server.serve()  # until training rank 0 says "stop"
    plan = server.hybrid.plan
    mine = dict(rank=rank, weight_path="direct" if server.engine.weight_format == "direct" else "full",
                sync_bytes=server.sync_bytes, payload_bytes=server.sync_payload_bytes, chunks_received=_chunks(plan, rank), shard_bytes=plan.needed_bytes[rank], bound_bytes=plan.min_recv_bytes[rank],
                vllm_shard_bytes=vllm_shard_bytes(server.engine), engine_ranks=list(server.engine_ranks))
    server.engine.close()
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(mine, f)


def _training_rank(cfg, groups, rank: int, args) -> None:
    from megarl.async_rollout.trainer_side import remote_setup
    from megarl.engine.engine import EngineConfig, MegatronEngine
    from megarl.hybrid import HybridEngine
    from megarl.models.weights import save_hf_checkpoint
    from megarl.distributed.parallel import ParallelDims

    dims = ParallelDims(world_size=TRAIN_SIZE, tp=2).initialize()
    actor = MegatronEngine(args.model, dims, EngineConfig(), trainable=False)
    with torch.no_grad():  # a "trained" actor: noise drawn per full tensor, then sharded
        for name, (shard, meta) in actor.local_weight_shards().items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919)
            shard.add_(meta.slice_of_full(torch.randn(meta.full_shape, generator=g) * 0.05))
    shards = actor.local_weight_shards()
    if actor.spec.tie_embeddings:
        shards.pop("output_layer.weight", None)
    setup = remote_setup(cfg, groups, rank)  # the rollout ranks build their engines and say what they load
    hybrid = HybridEngine(shards, train=dims.layout, rollout=setup.weight_layout, bucket_bytes=cfg.rollout.bucket_bytes,
                          convert=setup.convert, separate=groups)
    remote = setup.engine
    remote.load_weights(hybrid.stream())  # what HybridEngine.hand_over does: the version, then this rank's sends
    outs = remote.generate([RolloutRequest(tuple(ids), k) for k, ids in enumerate(PROMPTS)], GREEDY)
    export = f"{args.tmp}/export"
    save_hf_checkpoint(actor.module, actor.spec, dims, export, args.model)
    mine = dict(rank=rank, server=remote.server, tokens=[o.response_token_ids for o in outs], logprobs=[o.logprobs for o in outs],
                versions=[o.versions for o in outs], bytes_sent=hybrid.last_stats.bytes_sent, export=export,
                layout_tp=setup.weight_layout.tp, weight_path=setup.weight_path)
    dist.barrier()  # the export is complete on every training rank
    remote.stop()
    with open(f"{args.tmp}/rank{rank}.json", "w") as f:
        json.dump(mine, f)
    dims.destroy()


def _chunks(plan, rank: int) -> int:
    """Chunks this rank receives in one sync (each padded to megarl.hybrid.plan.ALIGN on the wire)."""
    return sum(len(op.chunks) for b in plan.buckets for op in b.ops if rank in op.dsts)


if __name__ == "__main__":
    main()
