"""The dry run's weight sync (megarl.tools.dryrun): the 3D-HybridEngine's plan into the rollout
layout, as the real run builds it, per rank, and the invariant that it covers every rollout shard once.

The real run (megarl.trainer) gathers every rank's `shard_metadata` of the actor's weight shards
and calls `make_plan` with the weight layout its rollout builder chose (megarl.rollout.build_rollout).
Here the metadata comes from the built (meta) actors, and the weight layout from the config with
the builder's own rules (`weight_layout`): the engine itself, which the real run asks, is not built.
Ranks with the same coordinates build once, so the metadata of the other ranks of a stage is
derived from one built rank of that stage (`rank_metadata`): a rank's shards differ from another's
of its stage only in their TP rank and in the global numbers of the experts it holds.
"""
from __future__ import annotations

import re

from megarl.capacity import arch_from_config, load_config, sync_bytes
from megarl.capacity.from_config import planner_inputs
from megarl.hybrid.plan import Plan, Span, build_specs, make_plan
from megarl.layout import RolloutLayout, assign_rollout, separate_assignment
from megarl.rollout import planned_weight_path
from megarl.rollout.vllm_direct import VOCAB_TENSORS, vocab_rows
from megarl.tools.dryrun_errors import InvariantError
from megarl.tools.dryrun_rank import RankBuild

VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: its embedding's rows are padded to this multiple
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def weight_layout(cfg, spec):
    """(RolloutLayout, weight path, why) the rollout builder takes for this config: the path from
    megarl.rollout.planned_weight_path, the decision megarl.rollout.build_rollout itself starts
    from; the direct path's layout assumes vLLM's model holds the shapes megarl's table expects
    (build_rollout confirms that against the engine, which a dry run does not build)."""
    r = cfg.rollout
    # separate placement builds its engine without the actor's adapters (megarl.async_rollout.engine_side):
    # merged weights go there, as the real run sends them
    lora_rank = cfg.actor.lora.rank if r.placement != "separate" else 0
    path, why, _ = planned_weight_path(r.engine, spec, r.tp, lora_rank=lora_rank, lora_targets=cfg.actor.lora.target_modules)
    if path == "adapter":
        return RolloutLayout(tp=1), path, why + " (this plan is the base's)"
    if path == "full":
        return RolloutLayout(tp=1), path, why
    padded = -(-spec.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    rows = vocab_rows(spec.vocab_size, padded, r.tp)
    return RolloutLayout(tp=r.tp, grouping="consecutive", rows=tuple((name, rows) for name in VOCAB_TENSORS)), path, why


def _as_rank(rows: list[tuple], source, target, experts_per_rank: int) -> list[tuple]:
    """The metadata rows of `source`'s shards as rank `target` of the same stage holds them: at
    target's TP rank (expert TP for experts), experts renumbered by its EP rank."""
    out = []
    shift = (target.ep - source.ep) * experts_per_rank
    for name, full_shape, dtype, tp_dim, tp_rank, tp_size, sub_chunks, local_shape in rows:
        expert = _EXPERT.search(name)
        if expert:
            name = name[:expert.start(1)] + str(int(expert.group(1)) + shift) + name[expert.end(1):]
        tp_rank = target.etp if expert else target.tp
        out.append((name, full_shape, dtype, tp_dim, tp_rank, tp_size, sub_chunks, local_shape))
    return out


def rank_metadata(builds: list[tuple[RankBuild, list[int]]], layout, spec) -> list[list[tuple]] | None:
    """Every rank's `shard_metadata` rows, from the built ranks; None when a pipeline stage has no
    built rank. Checked first: each built rank's rows equal those derived from its stage's first
    built rank (the derivation is what stands for the ranks not built)."""
    experts_per_rank = spec.num_experts // layout.ep if spec.is_moe else 0
    by_stage: dict[int, RankBuild] = {}
    built: dict[tuple, RankBuild] = {}
    for build, _ in builds:
        c = build.coords
        by_stage.setdefault(c.pp, build)
        built[(c.pp, c.tp, c.cp, c.ep, c.etp)] = build
        first = by_stage[c.pp]
        if sorted(_as_rank(first.sync_rows, first.coords, c, experts_per_rank)) != sorted(build.sync_rows):
            raise InvariantError(f"rank {build.rank}: its weight shards are not those of rank {first.rank} (same stage) "
                                 f"renumbered to its TP / EP rank; the sync plan cannot stand the unbuilt ranks in")
    if len(by_stage) < layout.pp:
        return None
    out = []
    for r in range(layout.world_size):
        c = layout.coords(r)
        same = built.get((c.pp, c.tp, c.cp, c.ep, c.etp))
        out.append(same.sync_rows if same is not None
                   else _as_rank(by_stage[c.pp].sync_rows, by_stage[c.pp].coords, c, experts_per_rank))
    return out


def plan_sync(cfg, layout, spec, builds: list[tuple[RankBuild, list[int]]]) -> tuple[Plan | None, dict]:
    """The real planner's plan for this run (None when not every stage is built) and its summary."""
    rollout, path, why = weight_layout(cfg, spec)
    summary = {"path": path, "why": why, "rollout_tp": rollout.tp, "grouping": rollout.grouping,
               "bucket_bytes": cfg.rollout.bucket_bytes}
    if rollout.tp != cfg.rollout.tp or rollout.grouping != "micro_dp":  # where the planner's sync figure stands elsewhere
        summary["planner_differs"] = (f"the planner's sync figure assumes rollout tp {cfg.rollout.tp} shards on the micro-DP "
                                      f"grouping; this run sends the {path} path's rollout tp {rollout.tp} "
                                      f"({rollout.grouping}) layout")
    if path == "adapter":
        summary["adapter_sync"] = adapter_sync(builds, layout)
    metadata = rank_metadata(builds, layout, spec)
    if metadata is None:
        summary["planned"] = False
        summary["not_planned"] = "not every pipeline stage built: the plan needs one rank of each (e.g. --ranks all)"
        return None, summary
    receivers = rollout_ranks(cfg, layout)
    if receivers is None:
        assignment = assign_rollout(layout, rollout)
    else:  # as megarl.hybrid.engine does under separate placement: the rollout ranks follow the training ranks
        assignment = separate_assignment(layout.world_size, receivers, rollout.tp)
    plan = make_plan(build_specs(metadata), layout, assignment, rollout.tp, cfg.rollout.bucket_bytes,
                     dict(rollout.rows), receivers=receivers)
    summary.update(planned=True, buckets=len(plan.buckets), model_bytes=plan.model_bytes,
                   ops=sum(len(b.ops) for b in plan.buckets),
                   placement="separate" if receivers is not None else "colocated")
    if receivers is not None:  # the ranks that load the weights are not in `ranks` (they build no model)
        summary["rollout_ranks"] = [{"rank": r, "sync_recv_bytes": plan.planned_recv_bytes[r],
                                     "sync_bound_bytes": plan.min_recv_bytes[r], "sync_needed_bytes": plan.needed_bytes[r]}
                                    for r in receivers]
    return plan, summary


ADAPTER_GATHER_BYTES = 4  # full_adapters gathers the adapters as float32


def adapter_sync(builds: list[tuple[RankBuild, list[int]]], layout) -> dict:
    """What the adapter path moves at every sync after the base's once (megarl.hybrid.lora_sync):
    megarl.models.lora.full_adapters all-gathers every rank's adapter shards over the whole world
    (float32), so each rank receives all the others' shards, data-parallel copies included, to
    assemble the whole adapter it hands to its engine. The ranks of a pipeline stage hold adapter
    shards of one size (the TP split is even), so one built rank per stage stands for its stage."""
    by_stage: dict[int, RankBuild] = {}
    for build, _ in builds:
        by_stage.setdefault(build.coords.pp, build)
    if len(by_stage) < layout.pp:
        return {"complete": False, "not_counted": "not every pipeline stage built (e.g. --ranks all)"}
    stage_of = [layout.coords(r).pp for r in range(layout.world_size)]
    gathered = sum(by_stage[p].adapter_elements for p in stage_of) * ADAPTER_GATHER_BYTES
    smallest = min(by_stage[p].adapter_elements for p in stage_of) * ADAPTER_GATHER_BYTES
    whole = sum(b.adapter_full_elements for b in by_stage.values()) * ADAPTER_GATHER_BYTES
    return {"complete": True, "adapter_bytes": whole, "gather_bytes_received_per_rank_max": gathered - smallest,
            "note": "per sync, every sync: the whole world's adapter shards gathered as float32 (data-parallel copies "
                    "included) to assemble the whole adapter (adapter_bytes) the engine loads"}


def rollout_ranks(cfg, layout) -> tuple[int, ...] | None:
    """The global ranks of the rollout engines under `rollout.placement=separate` (megarl.async_rollout.placement:
    after the training ranks), None when colocated."""
    if cfg.rollout.placement != "separate":
        return None
    return tuple(range(layout.world_size, layout.world_size + cfg.rollout.num_ranks))


def sent_bytes(plan: Plan) -> list[int]:
    """Per rank: the payload it sends in a full sync (a piece once to each rank it goes to)."""
    sent = [0] * len(plan.planned_recv_bytes)
    for bucket in plan.buckets:
        for chunk, src, dsts in bucket.transfers:
            sent[src] += chunk.nbytes * len(dsts)
    return sent


def _deliveries(plan: Plan):
    """(rank, chunk) for every chunk an op of the plan puts into a rank: what the ranks execute."""
    for bucket in plan.buckets:
        for op in bucket.ops:
            if op.kind == "all_gather":
                for member, chunks in op.segments:
                    for rank in op.group:
                        if rank != member:
                            yield from ((rank, c) for c in chunks)
            else:
                for rank in op.dsts:
                    yield from ((rank, c) for c in op.chunks)


def check_sync_cover(plan: Plan) -> None:
    """Every unit of every tensor each rollout rank needs is held already or received exactly once,
    over all the rows of the tensor (InvariantError naming the rank)."""
    got: dict[tuple[int, str], list] = {}
    for rank, chunk in _deliveries(plan):
        got.setdefault((rank, chunk.name), []).append((chunk.span, chunk.rows))
    receivers = range(len(plan.planned_recv_bytes)) if plan.receivers is None else plan.receivers
    for rank in receivers:
        for name in plan.order:
            s = plan.specs[name]
            L, need = plan.units(name), plan.needed_span(rank, name)
            rows_all = (0, s.full_shape[s.split_dim]) if s.split_dim is not None else (0, 1)
            pieces = [(span, rows or rows_all) for span, rows in got.pop((rank, name), [])]
            held = plan.held_tp_rank(rank, name)
            if held is not None and (overlap := need & s.held_span(held, L)) is not None:
                pieces.append((overlap, rows_all))
            _check_tiling(rank, name, need, rows_all, pieces)
    if got:
        (rank, name), _ = next(iter(got.items()))
        raise InvariantError(f"rank {rank}: the weight-sync plan sends it {name}, which its rollout shard does not hold")


def _check_tiling(rank: int, name: str, need: Span, rows: tuple[int, int], pieces: list) -> None:
    """The pieces (unit span x rows) lie inside `need` x `rows`, do not overlap, and fill it."""
    area = 0
    for i, (span, (lo, hi)) in enumerate(pieces):
        if span.lo < need.lo or span.hi > need.hi or lo < rows[0] or hi > rows[1]:
            raise InvariantError(f"rank {rank}: the weight-sync plan sends it units {span.lo}-{span.hi} (rows {lo}-{hi}) of "
                                 f"{name}, outside its rollout shard (units {need.lo}-{need.hi})")
        for other, (olo, ohi) in pieces[:i]:
            if span & other is not None and max(lo, olo) < min(hi, ohi):
                raise InvariantError(f"rank {rank}: the weight-sync plan gives it units {span.lo}-{span.hi} (rows {lo}-{hi}) "
                                     f"of {name} twice")
        area += (span.hi - span.lo) * (hi - lo)
    if area != (need.hi - need.lo) * (rows[1] - rows[0]):
        raise InvariantError(f"rank {rank}: the weight-sync plan leaves part of its rollout shard of {name} unsent "
                             f"({area} of {(need.hi - need.lo) * (rows[1] - rows[0])} unit-rows arrive or are held)")


def per_rank(plan: Plan | None) -> dict[int, dict]:
    """{rank: sync_recv_bytes, sync_send_bytes, sync_bound_bytes, sync_needed_bytes} of a full sync."""
    if plan is None:
        return {}
    sent = sent_bytes(plan)
    return {r: {"sync_recv_bytes": plan.planned_recv_bytes[r], "sync_send_bytes": sent[r],
                "sync_bound_bytes": plan.min_recv_bytes[r], "sync_needed_bytes": plan.needed_bytes[r]}
            for r in range(len(sent))}


def planner_sync(cfg, model_dir: str, layout) -> int:
    """The planner's weight-sync bytes received per GPU (its max over GPUs, megarl.capacity.sync_bytes:
    it assumes the rollout.tp layout on the micro-DP grouping, whatever path the engine takes)."""
    arch = arch_from_config(load_config(model_dir))
    _, lay, _ = planner_inputs(cfg)
    return int(sync_bytes(arch, lay, layout.world_size, layout.dp)["megarl_bytes_per_gpu"])
