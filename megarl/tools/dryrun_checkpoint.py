"""The dry run's checkpoint (megarl.tools.dryrun): what each rank writes in a real save, from the
sharded state dict the save itself builds (megarl.engine.checkpointing), and the invariant that
every piece of every sharded tensor is written by exactly one rank.

Megatron's dist-checkpointing writes a `ShardedTensor` only on its main replica (replica_id all
zeros). The state dict is built on the representative rank of each set of ranks with the same
coordinates; the others of the set hold the same pieces and differ in the replica id only, whose
last entry is the rank's position in the data-parallel group of the tensor (the dense DP x CP
group; the expert-DP group for routed experts), and `Piece.writes_on` derives it. That convention is
checked on every representative, so a Megatron that changes it fails here instead of miscounting.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.tools.dryrun_errors import InvariantError

# the checkpointed engines' directories (megarl.trainer.Trainer.checkpointed_engines: the reference is frozen, not saved)
CHECKPOINTED_ROLES = ("actor", "critic")


@dataclass(frozen=True)
class Piece:
    """One ShardedTensor piece of the save: `key` (under its engine's directory) at `offset`."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str
    nbytes: int
    replica_prefix: tuple[int, ...]  # the replica id without its data-parallel entry: zeros on the writing rank
    expert: bool  # replicated over the expert-DP group (routed experts), not the dense DP x CP group

    def writes_on(self, layout, rank: int) -> bool:
        """Whether `rank` (one of the ranks this piece's representative stands for) writes it."""
        return dp_position(layout, rank, self.expert) == 0 and not any(self.replica_prefix)


def dp_position(layout, rank: int, expert: bool) -> int:
    """The rank's position in the group its tensor is replicated over: expert DP for routed
    experts, else the dense DP x CP group (Megatron's dp-cp rank: the layout's replica)."""
    return layout.coords(rank).edp if expert else layout.replica(rank)


def engine_pieces(role: str, engine, layout) -> tuple[list[Piece], int, list[str]]:
    """(the sharded tensors `engine`'s checkpoint holds on this rank, the bytes its optimizer gathers
    on each rank while saving, problems of the save) from the save's own model state dict.

    The optimizer's pieces follow Megatron's fully_reshardable format (the one megarl saves,
    megarl.engine.checkpointing.OPTIM_CKPT_FORMAT): for every trainable model tensor, its fp32
    main copy and Adam's two moments, with the model tensor's shape, offset and replica id.
    They are derived rather than built by `optimizer.sharded_state_dict`, which would gather the
    optimizer state of the whole DP group (a minute per rank at 671B, on meta tensors) and which
    fails on the builds `misplaced_main_params` finds; tests/tools/test_dryrun.py checks the
    derivation against Megatron's own on a small model."""
    # deferred: megatron and torch (seconds to import) load only when this runs
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megarl.engine.checkpointing import model_sharded_state_dict

    try:
        state = model_sharded_state_dict(engine)
    except ValueError as err:  # a save the engine refuses (e.g. tied embeddings under vpp)
        raise InvariantError(f"rank {engine.dims.rank}: the {role}'s checkpoint cannot be saved: {err}") from None
    apply_factories(state)
    pieces = []
    for t in nested_values(state):
        if not isinstance(t, ShardedTensor):
            continue
        replica = t.replica_id if isinstance(t.replica_id, tuple) else (t.replica_id,)
        expert = ".mlp.experts." in t.key
        position = dp_position(layout, engine.dims.rank, expert)
        if replica[-1] != position:  # the convention Piece.writes_on stands on
            raise InvariantError(f"rank {engine.dims.rank}: {role} checkpoint tensor {t.key} has replica id {replica}, whose "
                                 f"last entry is not the rank's {'expert-' if expert else ''}data-parallel position {position}")
        common = dict(offset=tuple(t.global_offset), shape=tuple(t.local_shape), global_shape=tuple(t.global_shape),
                      replica_prefix=tuple(replica[:-1]), expert=expert)
        pieces.append(Piece(f"{role}/{t.key}", dtype=str(t.dtype).removeprefix("torch."),
                            nbytes=math.prod(t.local_shape) * t.data.element_size(), **common))
        if engine.optimizer is not None and t.data.requires_grad:  # a buffer (the router's expert bias) has no state
            for state_key in ("param", "exp_avg", "exp_avg_sq"):
                pieces.append(Piece(f"{role}/optimizer.state.{state_key}.{t.key}", dtype="float32",
                                    nbytes=math.prod(t.local_shape) * 4, **common))
    problems = [f"rank {engine.dims.rank}: {role}: {p}" for p in misplaced_main_params(engine)]
    return pieces, _optimizer_gather_bytes(engine), problems


def misplaced_main_params(engine) -> list[str]:
    """Megatron-Core 0.16's distributed optimizer lists a param group's float32 parameters before
    its bf16 ones' main copies, but its checkpoint index (`model_param_group_index_map`) keeps the
    buffer order: where a group mixes both, the save reads another parameter's state (a crash when
    the sizes differ, a swapped state when they agree). megarl's build without Transformer-Engine
    (the CPU one) keeps the norms in float32, so at model.dtype=bfloat16 the no-weight-decay group
    mixes them with the biases (GLM-4.5, Qwen2)."""
    found = []
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer] if engine.optimizer else []):
        index = getattr(opt, "model_param_group_index_map", {})
        for param, (group, order) in index.items():
            main = getattr(param, "main_param", None)
            if main is not None and opt.optimizer.param_groups[group]["params"][order] is not main:
                found.append(f"Megatron's optimizer checkpoint index gives a {tuple(param.shape)} parameter the main copy "
                             f"of a {tuple(opt.optimizer.param_groups[group]['params'][order].shape)} one (a param group "
                             f"mixing float32 and bfloat16 parameters): its save fails or swaps state")
    return found[:1]


def _optimizer_gather_bytes(engine) -> int:
    """Host bytes the distributed optimizer gathers on every rank while saving: Megatron's
    fully_reshardable format all-gathers the fp32 main weights and both Adam moments of this
    rank's whole model-parallel shard (DP times its own optimizer shard) before the write."""
    if engine.optimizer is None:
        return 0
    total = 0
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        total += sum(3 * 4 * buffer.numel_unpadded for buffer in getattr(opt, "buffers", []))
    return total


def written(pieces: list[Piece], layout, rank: int) -> list[Piece]:
    """The pieces `rank` writes."""
    return [p for p in pieces if p.writes_on(layout, rank)]


def check_written_once(writers: dict[tuple, list[int]], pieces_by_key: dict[str, list[Piece]], complete: bool) -> None:
    """Each piece written by one rank; with every rank built, each tensor's pieces fill it (InvariantError)."""
    for (key, offset), ranks in writers.items():
        if len(ranks) > 1:
            raise InvariantError(f"rank {ranks[1]}: writes checkpoint piece {key} at {list(offset)}, which rank {ranks[0]} "
                                 f"writes too")
    if not complete:
        return
    for key, pieces in pieces_by_key.items():
        done = {p.offset: p for p in pieces if (key, p.offset) in writers}
        area = sum(math.prod(p.shape) for p in done.values())
        if area != math.prod(pieces[0].global_shape):
            missing = sorted({p.offset for p in pieces} - set(done))[:1]
            raise InvariantError(f"checkpoint tensor {key}: its pieces written by the ranks cover {area:,} of "
                                 f"{math.prod(pieces[0].global_shape):,} elements (no rank writes the piece at "
                                 f"{list(missing[0]) if missing else '?'})")


def per_rank(builds, layout, complete: bool) -> tuple[dict[int, dict], dict]:
    """({rank: checkpoint_bytes, checkpoint_gather_bytes, checkpoint_shards}, summary) over the chosen
    ranks, after the written-once check; a shard is [key, offset, shape, dtype, bytes]."""
    out, writers, pieces_by_key = {}, {}, {}
    for build, members in builds:
        for p in build.checkpoint_pieces:
            pieces_by_key.setdefault(p.key, []).append(p)
        for r in members:
            mine = written(build.checkpoint_pieces, layout, r)
            for p in mine:
                writers.setdefault((p.key, p.offset), []).append(r)
            out[r] = {"checkpoint_bytes": sum(p.nbytes for p in mine), "checkpoint_gather_bytes": build.checkpoint_gather_bytes,
                      "checkpoint_shards": [[p.key, list(p.offset), list(p.shape), p.dtype, p.nbytes] for p in mine]}
    check_written_once(writers, pieces_by_key, complete)
    summary = {"bytes": sum(e["checkpoint_bytes"] for e in out.values()), "pieces": len(writers),
               "written_once": "checked over every rank" if complete else "checked over the chosen ranks (no piece twice)",
               "problems": [p for build, _ in builds for p in build.checkpoint_problems]}
    return out, summary
