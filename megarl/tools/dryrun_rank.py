"""One rank of a dry run (megarl.tools.dryrun): what that rank builds in a real run, on the meta
device in a fake world, and what it holds.

The engines are the trainer's own (`MegatronEngine` with the settings `megarl.step.engine_options.engine_config`
derives from the run config): the model chunks from config.json, LoRA adapters, Megatron's DDP
buffers and the distributed optimizer (its Adam state created as the checkpoint code creates it).
Only the weights are missing: nothing is read but config.json.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
import time

import torch

from megarl.distributed.parallel import ParallelDims
from megarl.engine.checkpointing import ensure_optimizer_state
from megarl.engine.engine import MegatronEngine
from megarl.hybrid.engine import shard_metadata, streamed_shards
from megarl.layout.parallel import RankCoords
from megarl.models import lora
from megarl.platform import fake_world
from megarl.step.engine_options import engine_config
from megarl.tools.dryrun_checkpoint import CHECKPOINTED_ROLES, engine_pieces
from megarl.tools.dryrun_errors import InvariantError

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _dtype(t: torch.Tensor) -> str:
    return DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))


@dataclass
class Tally:
    """Elements by dtype; bytes follow from the dtypes."""

    numel: Counter = field(default_factory=Counter)

    def add(self, t: torch.Tensor, numel: int | None = None) -> None:
        self.numel[_dtype(t)] += t.numel() if numel is None else numel

    @property
    def bytes(self) -> int:
        sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
        return sum(n * sizes[d] for d, n in self.numel.items())

    def as_dict(self) -> dict:
        return {"count": dict(sorted(self.numel.items())), "bytes": self.bytes}


@dataclass
class RoleBuild:
    """One engine (actor, critic or reference) on one rank."""

    role: str
    params: Tally = field(default_factory=Tally)  # DDP's parameter buffers (padding included) + parameters outside them
    grads: Tally = field(default_factory=Tally)  # DDP's gradient buffers
    optimizer: Tally = field(default_factory=Tally)  # fp32 main copies + Adam's two moments, this rank's shard
    # the model's elements on this rank by how they are split (`split_kind`), for the unique count
    kinds: Counter = field(default_factory=Counter)

    def unique_params(self, c: RankCoords) -> int:
        """Elements rank `c` is counted for, so that the sum over all ranks is the model's size: a
        TP-split tensor on every TP rank of the first dense replica, a replicated one on its TP rank
        0; expert tensors likewise over expert TP, on expert-DP replica 0."""
        first_replica = c.dp == 0 and c.cp == 0
        return (self.kinds["dense_split"] * first_replica + self.kinds["dense_replicated"] * (first_replica and c.tp == 0)
                + self.kinds["expert_split"] * (c.edp == 0) + self.kinds["expert_replicated"] * (c.edp == 0 and c.etp == 0))

    def as_dict(self) -> dict:
        return {"params": self.params.as_dict(), "grads": self.grads.as_dict(), "optimizer": self.optimizer.as_dict()}


@dataclass
class RankBuild:
    """What one rank built: its engines, the global layers of each of its model chunks (keyed by
    virtual stage), the global experts of each of its MoE layers; the actor's weight-sync metadata
    (megarl.hybrid.engine.shard_metadata rows) and its checkpoint's pieces (dryrun_checkpoint.Piece,
    actor and critic) with the bytes the optimizers gather while saving and what would break the save."""

    rank: int
    coords: RankCoords
    roles: list[RoleBuild]
    chunk_layers: dict[int, list[int]]
    layer_experts: dict[int, list[int]]
    seconds: float = 0.0
    sync_rows: list[tuple] = field(default_factory=list)
    checkpoint_pieces: list = field(default_factory=list)
    checkpoint_gather_bytes: int = 0
    checkpoint_problems: list[str] = field(default_factory=list)
    adapter_elements: int = 0  # the actor's LoRA adapter elements on this rank (its A and B shards)
    adapter_full_elements: int = 0  # the same adapters whole (as full_adapters assembles them)

    def total(self, part: str) -> int:
        return sum(getattr(r, part).bytes for r in self.roles)


def build_rank(cfg, model_dir: str, world_size: int, rank: int) -> RankBuild:
    """Be rank `rank` of a fake world of `world_size` and build its process groups and engines."""
    start = time.perf_counter()
    fake_world.enter(rank, world_size)
    p = cfg.parallel
    dims = ParallelDims(world_size=world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp,
                        first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers,
                        sequence_parallel=p.sequence_parallel)
    dims.initialize(seed=cfg.trainer.seed)
    coords = dims.layout.coords(rank)
    _check_groups(dims, coords)
    t = cfg.trainer
    engines = [("actor", MegatronEngine, dict(cfg=engine_config(cfg, "actor", t.total_steps)))]
    if cfg.algorithm.adv_estimator == "gae":
        engines.append(("critic", MegatronEngine, dict(cfg=engine_config(cfg, "critic", t.total_steps), value_head=True)))
    uses_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
    if uses_ref and not (cfg.actor.lora.rank > 0 and not cfg.ref.separate_model):  # the trainer's rule (megarl/trainer.py)
        engines.append(("ref", MegatronEngine, dict(cfg=engine_config(cfg, "ref", t.total_steps), trainable=False)))

    build = RankBuild(rank, coords, [], {}, {})
    for role, cls, kwargs in engines:
        directory = cfg.critic.model_path if role == "critic" and cfg.critic.model_path else model_dir
        with fake_world.MetaAllocation():
            engine = cls(directory, dims, meta=True, **kwargs)
            build.roles.append(_measure(role, engine))
            if role in CHECKPOINTED_ROLES:
                pieces, gathered, problems = engine_pieces(role, engine, dims.layout)
                build.checkpoint_pieces += pieces
                build.checkpoint_gather_bytes += gathered
                build.checkpoint_problems += problems
            if role == "actor":
                build.chunk_layers, build.layer_experts = _placement(engine)
                build.sync_rows = _sync_rows(engine)
                build.adapter_elements, build.adapter_full_elements = _adapter_elements(engine)
        del engine
    build.seconds = time.perf_counter() - start
    return build


def _sync_rows(engine) -> list[tuple]:
    """The actor's weight-sync metadata as the trainer hands it to the HybridEngine
    (megarl.rollout_side.build.actor_shards): a tied output layer is the embedding, streamed once. Under LoRA the
    merged and the base shards have the same shapes; the base's are taken (no merge on meta)."""
    shards = engine.base_weight_shards() if engine.lora else engine.local_weight_shards()
    return shard_metadata(streamed_shards(shards, engine.spec.tie_embeddings))


def _adapter_elements(engine) -> tuple[int, int]:
    """Elements of the LoRA adapters this rank's actor holds (its A and B shards, what
    megarl.models.lora.full_adapters gathers) and of the same adapters whole (rank x (in + out))."""
    held = whole = 0
    for _, _, adapter in lora.adapters(engine.chunks):
        for name, part in adapter.adapters.items():
            held += part.lora_A.numel() + part.lora_B.numel()
            whole += part.lora_A.shape[0] * (adapter.in_size + adapter.out_sizes[adapter.names.index(name)])
    return held, whole


def _check_groups(dims, coords: RankCoords) -> None:
    """Megatron's groups agree with megarl's rank map (megarl.layout): a rank whose groups disagree
    would exchange activations or gradients with the wrong peers."""
    got = dict(pp=dims.pp_rank, tp=dims.tp_rank, dp=dims.dp_rank, ep=dims.ep_rank, etp=dims.etp_rank)
    want = dict(pp=coords.pp, tp=coords.tp, dp=coords.dp, ep=coords.ep, etp=coords.etp)
    if got != want:
        raise InvariantError(f"rank {dims.rank}: Megatron's process groups place it at {got}, megarl's rank map at {want}")


def _measure(role: str, engine) -> RoleBuild:
    out = RoleBuild(role)
    in_buffers = set()
    for chunk in engine.chunks if engine.trainable else ():  # Megatron's DDP: dense and expert buffers
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            out.params.add(buffer.param_data)
            out.grads.add(buffer.grad_data)
            in_buffers.update(id(p) for p in buffer.params)
    for module in engine.modules:
        for name, param in module.named_parameters():
            if id(param) not in in_buffers:  # frozen: the reference, a LoRA base
                out.params.add(param)
            kind = split_kind(name, param, module)
            if kind is not None:
                out.kinds[kind] += param.numel()
        for name, buf in module.named_buffers():
            if name.endswith("expert_bias"):  # the router's score-correction bias: model state, a buffer in Megatron
                out.params.add(buf)
                out.kinds["dense_replicated"] += buf.numel()
    if engine.optimizer is not None:
        ensure_optimizer_state(engine)  # Adam's moments, as a step (or the checkpoint code) creates them
        for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
            main_copies = {id(p) for group in getattr(opt, "shard_fp32_from_float16_groups", []) for p in group}
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in main_copies:  # an fp32 copy of bf16 weights; an fp32 weight's shard is a view
                        out.optimizer.add(p)
                    for state in opt.optimizer.state[p].values():
                        if isinstance(state, torch.Tensor) and state.dim() > 0:
                            out.optimizer.add(state)
    return out


def split_kind(name: str, param, module) -> str | None:
    """How a parameter is split, from Megatron's own marks: dense or expert (`allreduce=False`), split
    over (expert) TP (`tensor_model_parallel`) or replicated; None for what is not a config.json
    parameter of its own: a tied output layer (the first stage's embedding) or a LoRA adapter."""
    if getattr(param, "shared", False) and name.startswith("output_layer") and not module.pre_process:
        return None
    if getattr(param, "is_lora", False):
        return None
    split = "split" if getattr(param, "tensor_model_parallel", False) else "replicated"
    return f"expert_{split}" if getattr(param, "allreduce", True) is False else f"dense_{split}"


def _placement(engine) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Global layer numbers (0-based) of each chunk, keyed by virtual stage, and the global experts
    of each MoE layer."""
    chunk_layers, layer_experts = {}, {}
    for vp, module in enumerate(engine.modules):
        layers = list(module.decoder.layers)
        chunk_layers[vp] = [layer.layer_number - 1 for layer in layers]
        for layer in layers:
            experts = getattr(layer.mlp, "local_expert_indices", None)
            if experts is not None:
                layer_experts[layer.layer_number - 1] = list(experts)
    return chunk_layers, layer_experts
