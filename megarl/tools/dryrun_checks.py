"""The dry run's invariants and report (megarl.tools.dryrun): what the built ranks hold against the
layout (megarl.layout), the model's config.json and the planner (megarl.capacity)."""
from __future__ import annotations

from collections import defaultdict

from megarl.capacity import arch_from_config, load_config, params_total
from megarl.capacity.estimate import engine_state, stage_tensors
from megarl.capacity.from_config import planner_inputs
from megarl.models.families import load_spec
from megarl.tools import dryrun_checkpoint, dryrun_sync
from megarl.tools.dryrun_errors import InvariantError
from megarl.tools.dryrun_rank import RankBuild

GIB = 2**30
PLANNER_TOLERANCE = 0.02  # the planner's per-rank bytes against the built ones (docs/operations.md)
PARTS = (("param_bytes", "params"), ("grad_bytes", "grads"), ("optimizer_bytes", "optimizer"))


def _spec(model_dir: str):
    return load_spec(model_dir)


def check_rank(build: RankBuild, layout, model_dir: str) -> None:
    """This rank's layers and experts are the ones megarl's layout gives it (InvariantError naming the rank)."""
    spec = _spec(model_dir)
    c = build.coords
    want = {vp: list(layers) for (pp, vp), layers in layout.chunk_layers(spec.num_layers).items() if pp == c.pp}
    if build.chunk_layers != want:
        raise InvariantError(f"rank {build.rank} (pipeline stage {c.pp}) holds layers {build.chunk_layers} by virtual stage; "
                             f"the layout gives it {want}")
    if not spec.is_moe:
        return
    per_rank = spec.num_experts // layout.ep
    experts = list(range(c.ep * per_rank, (c.ep + 1) * per_rank))
    moe_layers = [i for layers in want.values() for i in layers if spec.is_moe_layer(i)]
    if sorted(build.layer_experts) != moe_layers:
        raise InvariantError(f"rank {build.rank}: MoE layers {sorted(build.layer_experts)} built, expected {moe_layers}")
    for layer, got in build.layer_experts.items():
        if got != experts:
            raise InvariantError(f"rank {build.rank} (expert-parallel rank {c.ep}) holds experts {got[:4]}... of layer {layer}; "
                                 f"the layout gives it {experts[0]}..{experts[-1]}")


def _check_cover(builds: list[tuple[RankBuild, list[int]]], layout, spec, complete: bool) -> None:
    """Over the built ranks: each layer on exactly one (stage, virtual stage); each expert of a layer
    on exactly one expert-parallel rank of its stage; with every stage / EP rank built, none missing."""
    owners: dict[int, set] = defaultdict(set)
    experts: dict[tuple[int, int], dict[int, set]] = defaultdict(lambda: defaultdict(set))
    for build, _ in builds:
        for vp, layers in build.chunk_layers.items():
            for layer in layers:
                owners[layer].add((build.coords.pp, vp))
        for layer, held in build.layer_experts.items():
            for e in held:
                experts[(build.coords.pp, layer)][e].add(build.coords.ep)
    for layer, where in sorted(owners.items()):
        if len(where) != 1:
            raise InvariantError(f"layer {layer} is on several (stage, virtual stage) chunks: {sorted(where)}")
    if complete and sorted(owners) != list(range(spec.num_layers)):
        missing = sorted(set(range(spec.num_layers)) - set(owners))
        raise InvariantError(f"layers {missing} are on no pipeline stage")
    for (pp, layer), by_expert in experts.items():
        for e, eps in by_expert.items():
            if len(eps) != 1:
                rank = layout.rank_of(pp, 0, 0)
                raise InvariantError(f"expert {e} of layer {layer} is on expert-parallel ranks {sorted(eps)} of stage {pp} "
                                     f"(stage's first rank {rank})")
        if complete and sorted(by_expert) != list(range(spec.num_experts)):
            raise InvariantError(f"layer {layer} (stage {pp}, first rank {layout.rank_of(pp, 0, 0)}): experts "
                                 f"{sorted(set(range(spec.num_experts)) - set(by_expert))[:8]} are on no expert-parallel rank")


def planner_figures(cfg, model_dir: str, layout) -> dict[int, dict]:
    """The planner's param / grad / optimizer bytes per pipeline stage, summed over the roles the run builds."""
    arch = arch_from_config(load_config(model_dir))
    _, lay, run = planner_inputs(cfg)
    roles = ["actor"] + (["critic"] if run.critic else []) + (["ref"] if run.ref and not run.lora_rank else [])
    edp = layout.expert_dp if arch.is_moe else 1
    out = {}
    for stage in range(layout.pp):
        states = [engine_state(arch, lay, stage, run, layout.dp, edp, role) for role in roles]
        out[stage] = {"param_bytes": int(sum(s.params for s in states)), "grad_bytes": int(sum(s.grads for s in states)),
                      "optimizer_bytes": int(sum(s.optimizer for s in states))}
    return out


def parameters_from_config(model_dir: str) -> int:
    """The model's parameters from config.json (megarl.capacity.arch, as Hugging Face counts them,
    the routers' score-correction biases included; no multi-token-prediction layers)."""
    return params_total(arch_from_config(load_config(model_dir)))


def vocab_padding(spec, tp: int) -> int:
    """Parameters of the padding rows Megatron adds to the embedding (and an untied output layer)."""
    return (spec.padded_vocab_size(tp) - spec.vocab_size) * spec.hidden_size * (1 if spec.tie_embeddings else 2)


def report(cfg, model_dir: str, layout, builds: list[tuple[RankBuild, list[int]]], complete: bool) -> dict:
    """The JSON report; with every rank built (`complete`), the parameter-sum invariant; the
    weight-sync plan's cover (every stage built) and the checkpoint's written-once invariants."""
    spec = _spec(model_dir)
    _check_cover(builds, layout, spec, complete)
    from_config = parameters_from_config(model_dir)
    planner = planner_figures(cfg, model_dir, layout)
    sync_plan, sync = dryrun_sync.plan_sync(cfg, layout, spec, builds)
    if sync_plan is not None:
        dryrun_sync.check_sync_cover(sync_plan)
    sync_by_rank, planner_sync = dryrun_sync.per_rank(sync_plan), dryrun_sync.planner_sync(cfg, model_dir, layout)
    checkpoint_by_rank, checkpoint = dryrun_checkpoint.per_rank(builds, layout, complete)
    no_plan = dict.fromkeys(("sync_recv_bytes", "sync_send_bytes", "sync_bound_bytes", "sync_needed_bytes"))
    ranks, unique, unique_by_stage = [], 0, defaultdict(int)
    for build, members in builds:
        actor = build.roles[0]
        built = {key: build.total(part) for key, part in PARTS}
        plan = planner[build.coords.pp]
        for r in members:
            c = layout.coords(r)
            unique += actor.unique_params(c)
            unique_by_stage[c.pp] += actor.unique_params(c)
            ranks.append({"rank": r, "built_as": build.rank, "stands_for": members if r == build.rank else None,
                          "coordinates": {"pp": c.pp, "tp": c.tp, "cp": c.cp, "dp": c.dp, "ep": c.ep, "etp": c.etp, "edp": c.edp},
                          "layers": build.chunk_layers, **built, "planner": plan,
                          "planner_difference": {k: _relative(plan[k], v) for k, v in built.items()},
                          **sync_by_rank.get(r, no_plan), "planner_sync_recv_bytes_max": planner_sync,
                          **checkpoint_by_rank[r],
                          "roles": {role.role: role.as_dict() for role in build.roles}})
    ranks.sort(key=lambda e: e["rank"])
    padding = vocab_padding(spec, layout.tp)
    if complete and unique - padding != from_config:
        worst = _stage_short(unique_by_stage, cfg, model_dir, layout)
        raise InvariantError(f"the unique parameters over all ranks sum to {unique:,} ({padding:,} of them vocabulary padding); "
                             f"config.json gives {from_config:,}: a difference of {unique - padding - from_config:,}{worst}")
    return {"world_size": layout.world_size, "layout": layout.describe(), "model": spec.family,
            "total_unique_parameters": unique - padding if complete else None, "vocabulary_padding_parameters": padding,
            "parameters_from_config": from_config, "ranks_built": len(builds), "weight_sync": sync,
            "checkpoint": checkpoint, "ranks": ranks,
            "planner_outside_tolerance": [e["rank"] for e in ranks
                                          if any(abs(d) > PLANNER_TOLERANCE for d in e["planner_difference"].values() if d is not None)]}


def _relative(plan: int, built: int) -> float | None:
    return None if built == 0 and plan == 0 else (plan - built) / max(built, 1)


def _stage_short(unique_by_stage: dict[int, int], cfg, model_dir: str, layout) -> str:
    """Where the sum goes wrong: the first pipeline stage whose unique parameters differ from the
    planner's tensors of that stage (megarl.capacity.estimate.stage_tensors, padded vocabulary)."""
    arch, (_, lay, _) = arch_from_config(load_config(model_dir)), planner_inputs(cfg)
    for stage in range(layout.pp):
        want = sum(t.numel * t.count for t in stage_tensors(arch, lay, stage))
        if unique_by_stage[stage] != want:
            return (f"; stage {stage} (ranks from {layout.rank_of(stage, 0, 0)}) holds {unique_by_stage[stage]:,} unique "
                    f"parameters where config.json gives it {want:,}")
    return ""


def render(report: dict) -> str:
    """One line per build, then the totals."""
    lines = [f"dry run of {report['model']} at {report['layout']}: {report['ranks_built']} builds for {len(report['ranks'])} ranks",
             f"{'rank':>6} {'stands for':>10} {'pp':>3} {'ep':>3} {'layers':>9}  {'params GiB':>17} {'grads GiB':>17} "
             f"{'optimizer GiB':>17}   (built / planner)  {'sync recv / bound GiB':>21} {'send GiB':>8} {'ckpt GiB':>8}"]
    for e in report["ranks"]:
        if e["stands_for"] is None:
            continue
        layers = [i for chunk in e["layers"].values() for i in chunk]
        span = f"{min(layers)}-{max(layers)}" if layers else "-"
        cells = " ".join(f"{e[k] / GIB:8.2f}/{e['planner'][k] / GIB:8.2f}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        c = e["coordinates"]
        sync = (f"{e['sync_recv_bytes'] / GIB:10.2f}/{e['sync_bound_bytes'] / GIB:10.2f} {e['sync_send_bytes'] / GIB:8.2f}"
                if e["sync_recv_bytes"] is not None else f"{'-':>21} {'-':>8}")
        lines.append(f"{e['rank']:>6} {len(e['stands_for']):>10} {c['pp']:>3} {c['ep']:>3} {span:>9}  {cells}"
                     f"{'':22}{sync} {e['checkpoint_bytes'] / GIB:8.2f}")
    total = report["total_unique_parameters"]
    lines.append(f"parameters: config.json {report['parameters_from_config']:,}; "
                 + (f"built, unique over all ranks {total:,} (+ {report['vocabulary_padding_parameters']:,} vocabulary padding): "
                    f"equal" if total is not None else "not every rank built: the sum is not checked (--ranks all)"))
    off = report["planner_outside_tolerance"]
    lines.append("planner: within 2% of the built bytes on every rank" if not off else
                 f"planner: more than 2% off the built bytes on ranks {off[:16]}{'...' if len(off) > 16 else ''} (see planner_difference)")
    sync = report["weight_sync"]
    if sync["planned"]:
        # separate placement: the training ranks only send; the rollout ranks (not built) receive
        worst = max(sync.get("rollout_ranks") or report["ranks"], key=lambda e: e["sync_recv_bytes"])
        lines.append(f"weight sync ({sync['path']} path, {sync['placement']}, rollout tp {sync['rollout_tp']}, {sync['buckets']} "
                     f"buckets): every rollout shard covered once; most received: rank {worst['rank']}, "
                     f"{worst['sync_recv_bytes'] / GIB:.2f} GiB (bound {worst['sync_bound_bytes'] / GIB:.2f}; "
                     f"planner {report['ranks'][0]['planner_sync_recv_bytes_max'] / GIB:.2f})")
        if "planner_differs" in sync:
            lines.append(f"weight sync: {sync['planner_differs']}")
        if sync.get("adapter_sync", {}).get("complete"):
            a = sync["adapter_sync"]
            lines.append(f"weight sync, every step after the first: the adapters, {a['adapter_bytes'] / GIB:.2f} GiB whole; "
                         f"each rank receives up to {a['gather_bytes_received_per_rank_max'] / GIB:.2f} GiB gathering them")
    else:
        lines.append(f"weight sync ({sync['path']} path, rollout tp {sync['rollout_tp']}): not planned: {sync['not_planned']}")
    ckpt = report["checkpoint"]
    most = max(report["ranks"], key=lambda e: e["checkpoint_bytes"])
    lines.append(f"checkpoint: {ckpt['pieces']:,} sharded-tensor pieces, each written by one rank ({ckpt['written_once']}); "
                 f"most written: rank {most['rank']}, {most['checkpoint_bytes'] / GIB:.2f} GiB; the optimizer gathers "
                 f"{most['checkpoint_gather_bytes'] / GIB:.2f} GiB on its host while saving")
    for problem in ckpt["problems"][:4]:
        lines.append(f"checkpoint problem: {problem}")
    lines.append(f"wall time {report.get('wall_seconds', 0):.1f} s")
    return "\n".join(lines)
