"""The rollout construction of the PPO trainer, once at start: the inference engine (local, or this
rank's handle on a separate server), the 3D-HybridEngine that feeds it the actor's weights (or,
under actor.lora into vLLM, the adapter sync), the dispatch groups, the run's sampling parameters,
and the rollout side around them (`build_rollout_side`). The rollout builder says which weight
layout the engine's load_weights accepts with its converter (vLLM on the dense families: each
rank's own rollout shard; otherwise full HF tensors) and owns each backend's options."""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch.distributed as dist

from megarl.async_rollout.trainer_side import remote_setup
from megarl.hybrid.dispatch import DispatchGroups
from megarl.hybrid.engine import HybridEngine, release_cached_device_memory, streamed_shards
from megarl.hybrid.lora_sync import AdapterSync
from megarl.rewards.decode import check_token_ids
from megarl.layout import RolloutLayout
from megarl.rollout import RolloutSetup, build_rollout, full_hf_converter
from megarl.rollout.base import SamplingParams, stop_token_ids
from megarl.rollout.multi_turn import with_environment
from megarl.rollout_side import RolloutSide, WeightHandOver, build_rollout_side
from megarl.rollout_side.fleet import open_fleet


def build_trainer_rollout(cfg, dims, actor, tokenizer, data, *, offload: Callable[[], None], to_samples, score, global_batch,
                          separate=None, log=None) -> tuple[RolloutSide, SamplingParams]:
    """(the rollout side, the run's sampling parameters) of the PPO trainer. actor: the actor's
    MegatronEngine; offload: moves every engine's training state out of the rollout's way; data: the
    training prompts; separate: rollout.placement=separate's world split (None: colocated); log: rank 0's."""
    r, t = cfg.rollout, cfg.trainer
    # Offloads as configured before the engine is built: vLLM and SGLang size their memory pools
    # from what is free at that moment (megarl/capacity/memory_check.py decides the offloads left null).
    offload()
    release_cached_device_memory()
    max_model_len = cfg.data.max_prompt_tokens + r.max_new_tokens  # a sequence's tokens, as vLLM sizes them
    if r.placement == "fleet":  # servers outside the torchrun world generate (megarl.rollout_side.fleet)
        setup = fleet_setup(cfg, dims, actor, max_model_len, log)
    elif separate is None:
        setup = build_rollout(r.engine, cfg.model.path, dims.rollout_groups(r.tp), seed=t.seed, device=str(actor.device),
                              dtype=actor.params_dtype, memory_fraction=r.gpu_memory_utilization,
                              max_model_len=max_model_len, train_tp=dims.tp,
                              log=log, lora_rank=cfg.actor.lora.rank,
                              lora_targets=cfg.actor.lora.target_modules, record_routes=cfg.actor.routing_replay)
    else:  # the engine runs on the rollout ranks: this rank's handle on its server
        setup = remote_setup(cfg, separate, dims.rank)
    # actor.lora into vLLM: the base once, then only the adapters (megarl.hybrid.lora_sync)
    adapter_sync = AdapterSync(actor, actor.lora, cfg.model.path) if setup.weight_path == "adapter" else None
    shards = partial(actor_shards, actor)
    hybrid = HybridEngine(shards(), train=dims.layout, rollout=setup.weight_layout, bucket_bytes=r.bucket_bytes,
                          convert=setup.convert, separate=separate, mode=r.weight_sync.mode, full_every=r.weight_sync.full_every)
    # the ranks holding one DP batch split its prompts (CP ranks too: each generates its share, not all)
    batch_group, groups = dims.batch_group, setup.groups
    dispatch = DispatchGroups(mp_group=batch_group, mp_rank=dist.get_rank(batch_group), mp_size=dist.get_world_size(batch_group),
                              rollout_group=groups.group, rollout_rank=groups.rank, rollout_size=groups.size)
    stop = stop_token_ids(r, tokenizer.eos_token_id)
    for key, ids in (("rollout.stop_token_ids", stop), ("rollout.banned_token_ids", r.banned_token_ids)):
        check_token_ids(key, ids, actor.spec.vocab_size)
    data.check_vocab(actor.spec.vocab_size)
    sampling = SamplingParams(n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                              top_k=max(r.top_k, 0), max_new_tokens=r.max_new_tokens, stop_token_ids=stop, seed=t.seed,
                              banned_token_ids=tuple(r.banned_token_ids))
    # the side of the step that generates (megarl.rollout_side): colocated or separate, inside
    # dynamic sampling; under rollout.multi_turn its engine runs an episode per sample
    side = build_rollout_side(
        cfg, setup=setup, engine=with_environment(setup.engine, r, tokenizer, log=log),
        hand_over=WeightHandOver(hybrid, adapter_sync, offload, shards), dispatch=dispatch,
        data=data, sampling=sampling, to_samples=to_samples, score=score,
        global_batch=global_batch, dims=dims, separate=separate)
    return side, sampling


def actor_shards(actor) -> dict:
    """The actor's weights for the rollout engine (a tied output layer once, as the embedding)."""
    return streamed_shards(actor.local_weight_shards(), actor.spec.tie_embeddings)


def fleet_setup(cfg, dims, actor, max_model_len: int, log) -> RolloutSetup:
    """rollout.placement=fleet: the fleet's engine takes full HF tensors, as the hf engine does."""
    engine = open_fleet(cfg, cfg.model.path, actor.params_dtype, dims.rank, max_model_len, log=log or print)
    return RolloutSetup(engine=engine, weight_layout=RolloutLayout(tp=1), groups=dims.rollout_groups(1),
                        convert=full_hf_converter(cfg.model.path, dims.tp), weight_path="full",
                        weight_path_reason="the fleet's servers load full HF tensors")
