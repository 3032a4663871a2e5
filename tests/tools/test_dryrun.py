"""The dry run (megarl.tools.dryrun): every rank of a real-size world built on one CPU, on the fake
backend and the meta device, checked against the layout, the model's config.json and the planner.

Independent references: parameter counts of transformers' own models built from the same
config.json files on the meta device (the routers' score-correction biases, buffers there, added):
DeepSeek-V3 671,026,419,200; GLM-4.5 352,797,829,024; Qwen3-235B-A22B 235,093,634,560; Llama-3-70B
70,553,706,496 (measured with transformers 5.25, 2026-12-05; the tiny models' counts are taken the
same way inside the test).
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from megarl.tools import dryrun
from megarl.tools.dryrun_checks import check_rank, _check_cover
from megarl.tools.dryrun_errors import InvariantError
from megarl.tools.dryrun_rank import RankBuild, RoleBuild

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "configs" / "models"

TRANSFORMERS_COUNTS = {"deepseek-v3": 671_026_419_200, "glm-4.5": 352_797_829_024, "qwen3-235b-a22b": 235_093_634_560,
                       "llama-3-70b-instruct": 70_553_706_496}


def transformers_count(model_dir: Path) -> int:
    """Parameters (plus DeepSeek-style correction-bias buffers) of transformers' model on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))


def run_dry(tmp_path, config: str, world: int, overrides: list[str], ranks: str = "all") -> tuple[int, dict | None]:
    out = tmp_path / "dry.json"
    code = dryrun.run(config, world, overrides, ranks, str(out))
    return code, json.loads(out.read_text()) if out.exists() else None


TINY = ["model.make_tiny.enable=false", "actor.use_kl_loss=true", "model.dtype=bfloat16"]
TINY_CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")


def launch_main(argv: list[str]) -> int:
    """launch/ppo.py's main, in this process (what a user types, without a subprocess)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_ppo", REPO / "launch" / "ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_tiny_deepseek_every_rank_sums_to_transformers_count(tmp_path, tiny_moe_671b_models):
    """World 8 = pp2 x dp4, ep2 x edp2, uneven stages (1 + 3 layers): every rank built; the unique
    parameters sum to transformers' count; each layer on one stage, each expert on one EP rank; the
    planner within 2% on every rank."""
    model = tiny_moe_671b_models["deepseek_v3"]
    code, rep = run_dry(tmp_path, TINY_CONFIG, 8, TINY + [
        f"model.path={model}", "parallel.pp=2", "parallel.ep=2", "parallel.first_stage_layers=1", "parallel.last_stage_layers=3"])
    assert code == 0
    assert rep["world_size"] == 8 and len(rep["ranks"]) == 8
    assert rep["total_unique_parameters"] == rep["parameters_from_config"] == transformers_count(model)
    by_rank = {e["rank"]: e for e in rep["ranks"]}
    assert by_rank[0]["layers"] == {"0": [0]} and by_rank[7]["layers"] == {"0": [1, 2, 3]}
    for e in rep["ranks"]:
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert e[key] > 0 and abs(e["planner"][key] - e[key]) <= 0.02 * e[key], (e["rank"], key)
    # ranks differing only in dp share a build; each optimizer shard holds 1/dp of the dense state
    assert sum(1 for e in rep["ranks"] if e["stands_for"]) < 8
    # The weight sync into the hf engine (full tensors on every rank): each rank needs the whole
    # model and receives exactly what its stage does not hold (the plan's bound); what is sent is
    # what is received.
    sync = rep["weight_sync"]
    assert sync["planned"] and sync["path"] == "full" and sync["rollout_tp"] == 1
    for e in rep["ranks"]:
        assert e["sync_needed_bytes"] == sync["model_bytes"] and e["sync_recv_bytes"] == e["sync_bound_bytes"] > 0, e["rank"]
    assert sum(e["sync_send_bytes"] for e in rep["ranks"]) == sum(e["sync_recv_bytes"] for e in rep["ranks"])
    # The checkpoint: over all ranks the written model pieces are the model once (the same bytes
    # the sync streams), the optimizer's three fp32 tensors per trainable element (not the 3 x 8
    # routers' expert biases, buffers).
    assert rep["checkpoint"]["written_once"] == "checked over every rank" and rep["checkpoint"]["problems"] == []
    shards = [s for e in rep["ranks"] for s in e["checkpoint_shards"]]
    model = [s for s in shards if "/optimizer." not in s[0]]
    assert sum(math.prod(s[2]) for s in model) == rep["total_unique_parameters"]
    assert sum(s[4] for s in model) == sync["model_bytes"]
    assert sum(math.prod(s[2]) for s in shards if "/optimizer." in s[0]) == 3 * (rep["total_unique_parameters"] - 24)
    assert sum(e["checkpoint_bytes"] for e in rep["ranks"]) == sum(s[4] for s in shards) == rep["checkpoint"]["bytes"]
    # dense pieces on the first data-parallel replica only (ranks 0 and 4 hold dp 0), experts on expert-DP 0
    assert [e["rank"] for e in rep["ranks"] if e["checkpoint_bytes"]] == [0, 4, 5]


def test_tiny_vpp_tp2_lora(tmp_path):
    """A dense model at tp2 x pp2 x vpp2 with LoRA: every virtual stage's layers once, the base
    frozen (no gradient or optimizer state beyond the adapters), the sum still the model's."""
    from megarl.tools.make_tiny_model import make_tiny_model

    model = tmp_path / "qwen3"
    make_tiny_model("qwen3", model, vocab_size=301, layers=4)
    code, rep = run_dry(tmp_path, TINY_CONFIG, 8, TINY + [
        f"model.path={model}", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "actor.lora.rank=4"])
    assert code == 0
    assert rep["total_unique_parameters"] == rep["parameters_from_config"] == transformers_count(model)
    first = rep["ranks"][0]
    assert first["layers"] == {"0": [0], "1": [2]}
    assert "ref" not in first["roles"]  # under LoRA the reference is the actor with its adapters off
    actor = first["roles"]["actor"]
    assert actor["grads"]["bytes"] < actor["params"]["bytes"] / 4  # adapters only
    assert not rep["planner_outside_tolerance"]


def test_tiny_separate_placement_syncs_into_the_rollout_ranks(tmp_path):
    """rollout.placement=separate, world 4 = 2 training ranks (tp2) + 2 rollout ranks: the plan is the
    one megarl.hybrid.engine makes there: the training ranks receive nothing, each rollout rank (no
    training shard) receives the whole model once, the training ranks send exactly that."""
    from megarl.tools.make_tiny_model import make_tiny_model

    model = tmp_path / "qwen3"
    make_tiny_model("qwen3", model, vocab_size=301, layers=2)
    code, rep = run_dry(tmp_path, TINY_CONFIG, 4, TINY + [
        f"model.path={model}", "parallel.tp=2", "rollout.placement=separate", "rollout.num_ranks=2"])
    assert code == 0
    assert rep["world_size"] == 2 and [e["rank"] for e in rep["ranks"]] == [0, 1]
    sync = rep["weight_sync"]
    assert sync["planned"] and sync["placement"] == "separate"
    rollout = sync["rollout_ranks"]
    assert [r["rank"] for r in rollout] == [2, 3]
    for r in rollout:
        assert r["sync_recv_bytes"] == r["sync_bound_bytes"] == r["sync_needed_bytes"] == sync["model_bytes"] > 0, r
    assert all(e["sync_recv_bytes"] == 0 for e in rep["ranks"])
    assert sum(e["sync_send_bytes"] for e in rep["ranks"]) == 2 * sync["model_bytes"]


# --- the shipped configs at their published world sizes, on the ranks that differ -------------------
SHIPPED = [  # config, model dir, world size, ranks whose shards differ in shape (first / middle / last stage ...)
    ("deepseek-v3-671b.yaml", "deepseek-v3", 256, "0,16,255"),  # 3 dense layers + embedding; 4 MoE; 2 + head
    ("glm-4.5-355b.yaml", "glm-4.5", 256, "0,33,255"),  # 8 layers (3 dense); 12 MoE (tp rank 1); 12 + head
    ("qwen3-235b-a22b.yaml", "qwen3-235b-a22b", 256, "0,32,255"),  # vpp2: 6 + 6 layers; 6 + 6; 5 + 5 + head
    ("llama-3-70b-lora.yaml", "llama-3-70b-instruct", 8, "0"),  # tp8: every rank holds the same shapes
]


@pytest.mark.parametrize("config,model,world,ranks", SHIPPED, ids=[s[1] for s in SHIPPED])
def test_shipped_config_at_its_world_size(tmp_path, config, model, world, ranks):
    """Each shipped config at its published layout: the ranks whose shards differ build, match the
    layout and the planner within 2%; config.json's count is transformers' (the --ranks all run that
    checks the full sum is in docs/operations.md)."""
    text = (REPO / "configs" / config).read_text()
    assert f"--world-size {world}" in text  # the config names its world size for the dry run
    code, rep = run_dry(tmp_path, str(REPO / "configs" / config), world, [f"model.path={MODELS / model}"], ranks)
    assert code == 0
    assert rep["world_size"] == world and [e["rank"] for e in rep["ranks"]] == [int(r) for r in ranks.split(",")]
    assert rep["parameters_from_config"] == TRANSFORMERS_COUNTS[model]
    assert rep["planner_outside_tolerance"] == []
    for e in rep["ranks"]:
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert abs(e["planner"][key] - e[key]) <= 0.02 * e[key], (e["rank"], key)
    # the checkpoint: no piece written twice over these ranks, rank 0 (first replica) writes;
    # the weight-sync plan needs every stage (all of them for llama's single stage, else not planned)
    assert rep["ranks"][0]["checkpoint_bytes"] > 0
    for problem in rep["checkpoint"]["problems"]:  # GLM-4.5's qkv bias beside float32 norms (dryrun_checkpoint)
        assert model == "glm-4.5" and "mixing float32 and bfloat16 parameters" in problem, problem
    assert rep["weight_sync"]["planned"] == (model == "llama-3-70b-instruct")
    if rep["weight_sync"]["planned"]:  # LoRA into vLLM: the frozen base once as full tensors (tp8 -> 1/8 held)
        assert rep["weight_sync"]["path"] == "adapter"
        for e in rep["ranks"]:
            assert e["sync_recv_bytes"] == e["sync_bound_bytes"]
            assert 0.87 < e["sync_recv_bytes"] / e["sync_needed_bytes"] < 0.875  # 7/8 of it, less the whole norms held
        # then at every sync the adapters only, hand-worked: rank 32 on q, o (8192 -> 8192), k, v (8192 -> 1024),
        # gate, up (8192 -> 28672), down (28672 -> 8192): 32 x (in + out) each, 80 layers, gathered as float32;
        # each rank receives the other 7 tp ranks' shards (the column-parallel A factors are whole on every rank)
        per_layer = 32 * (2 * 16384 + 2 * 9216 + 3 * 36864)
        adapters = rep["weight_sync"]["adapter_sync"]
        assert adapters["adapter_bytes"] == 80 * per_layer * 4 == 1_656_750_080
        assert adapters["complete"] and adapters["gather_bytes_received_per_rank_max"] > 7 / 8 * adapters["adapter_bytes"]


# --- layouts that cannot work: one line, exit 2, before any model is built ------------------------
BAD = [
    (["parallel.ep=3"], "does not divide the model's 8 routed experts"),
    (["parallel.pp=3"], "layers do not split over pp=3"),
    (["rollout.engine=vllm", "rollout.tp=3"], "rollout.tp = 3 does not divide the model's 4 attention heads"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=["experts-over-ep", "layers-over-pp", "rollout-tp-over-heads"])
def test_unbuildable_layout_exits_2_before_building(tmp_path, tiny_moe_671b_models, monkeypatch, capsys, overrides, message):
    import megarl.tools.dryrun_rank as dryrun_rank

    monkeypatch.setattr(dryrun_rank, "build_rank", lambda *a, **k: pytest.fail("a model was built"))
    model = tiny_moe_671b_models["deepseek_v3"]
    argv = ["--config", TINY_CONFIG, "--dry-run", "--world-size", "6", *TINY, f"model.path={model}",
            "data.prompts_per_step=36", *overrides]
    assert launch_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_unbuildable_layout_exits_2_from_a_real_launch(tiny_moe_671b_models, monkeypatch, capsys):
    """launch/ppo.py without --dry-run refuses the same layout in its config check, before any process group."""
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    model = tiny_moe_671b_models["deepseek_v3"]
    code = launch_main(["--config", TINY_CONFIG, *TINY, f"model.path={model}", "data.prompts_per_step=36", "parallel.ep=3"])
    assert code == 2
    assert "does not divide the model's 8 routed experts" in capsys.readouterr().err


# --- the invariants, each failing with one line naming the rank -----------------------------------
def _build(rank, pp, ep, layers, experts=None):
    from megarl.layout.parallel import RankCoords

    return RankBuild(rank, RankCoords(pp=pp, tp=0, dp=0, ep=ep), [RoleBuild("actor", kinds=Counter())], layers, experts or {})


def test_invariants_name_the_rank(tiny_moe_671b_models):
    from megarl.layout import ParallelLayout
    from megarl.models.families import load_spec

    model = str(tiny_moe_671b_models["deepseek_v3"])  # 4 layers, the first dense; 8 experts
    layout = ParallelLayout.for_world(4, pp=2, ep=2)
    check_rank(_build(2, 1, 0, {0: [2, 3]}, {2: [0, 1, 2, 3], 3: [0, 1, 2, 3]}), layout, model)  # as the layout says
    with pytest.raises(InvariantError, match=r"^rank 2 \(pipeline stage 1\) holds layers"):
        check_rank(_build(2, 1, 0, {0: [1, 2]}), layout, model)
    with pytest.raises(InvariantError, match=r"^rank 3 \(expert-parallel rank 1\) holds experts"):
        check_rank(_build(3, 1, 1, {0: [2, 3]}, {2: [0, 1, 2, 3], 3: [4, 5, 6, 7]}), layout, model)
    spec = load_spec(model)
    twice = [(_build(0, 0, 0, {0: [0, 1]}), [0]), (_build(2, 1, 0, {0: [1, 2, 3]}), [2])]
    with pytest.raises(InvariantError, match="layer 1 is on several"):
        _check_cover(twice, layout, spec, complete=True)
    missing = [(_build(0, 0, 0, {0: [0, 1]}), [0]), (_build(2, 1, 0, {0: [2, 3]}, {2: [0, 1, 2, 3]}), [2])]
    with pytest.raises(InvariantError, match=r"layer 2 \(stage 1, first rank 2\): experts \[4, 5, 6, 7\] are on no"):
        _check_cover(missing, layout, spec, complete=True)


def test_fake_world_builds_megatron_groups_at_256():
    """The platform seam the dry run stands on: rank 200 of a fake world of 256 gets Megatron's groups
    (its gloo groups included) and the coordinates megarl's rank map gives it."""
    from megarl.distributed.parallel import ParallelDims
    from megarl.platform import fake_world, init_platform

    init_platform(force_cpu=True)
    fake_world.enter(200, 256)
    try:
        dims = ParallelDims(world_size=256, pp=16, ep=16).initialize()
        c = dims.layout.coords(200)
        assert (dims.pp_rank, dims.dp_rank, dims.ep_rank) == (c.pp, c.dp, c.ep) == (12, 8, 8)
        from megatron.core import parallel_state

        assert parallel_state.get_data_parallel_group_gloo() is not None
    finally:
        fake_world.leave()


def test_a_shard_missing_from_the_sum_names_its_stage(tmp_path, tiny_moe_671b_models, monkeypatch, capsys):
    """Were the routers of the MoE layers counted nowhere (a mistake in the build or the count), the
    parameter sum fails with one line naming the stage and its first rank (exit 1)."""
    import megarl.tools.dryrun_rank as dryrun_rank

    real = dryrun_rank.split_kind
    monkeypatch.setattr(dryrun_rank, "split_kind", lambda name, p, m: None if ".router." in name else real(name, p, m))
    model = tiny_moe_671b_models["deepseek_v3"]  # layer 0 dense, 1-3 MoE: stage 0 holds 0-1, stage 1 holds 2-3
    code, rep = run_dry(tmp_path, TINY_CONFIG, 4, TINY + [f"model.path={model}", "parallel.pp=2", "parallel.ep=2"])
    assert code == 1 and rep is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage 0 (ranks from 0) holds" in err[0], err


# --- the weight-sync plan and the checkpoint: the invariants fail on a corrupted plan / save -------
def _small_plan():
    """The real planner on 4 ranks (tp2 x dp2) into rollout tp 1: w (8, 4) split in rows over TP,
    norm (4,) whole; each rank holds half of w and needs all of it, from its TP peer."""
    from megarl.hybrid.plan import build_specs, make_plan
    from megarl.layout import ParallelLayout, RolloutLayout, assign_rollout

    layout = ParallelLayout.for_world(4, tp=2)
    meta = [[("w", (8, 4), "torch.float32", 0, layout.coords(r).tp, 2, 1, (4, 4)),
             ("norm", (4,), "torch.float32", None, layout.coords(r).tp, 2, 1, (4,))] for r in range(4)]
    return make_plan(build_specs(meta), layout, assign_rollout(layout, RolloutLayout(tp=1)), 1, 1 << 20)


def test_sync_cover_fails_on_a_corrupted_plan():
    """The plan as made covers every rollout shard once; without one of its ops, or with one twice,
    the check fails with one line naming a rank."""
    import copy

    from megarl.tools.dryrun_sync import check_sync_cover, per_rank

    plan = _small_plan()
    check_sync_cover(plan)
    # hand-worked: each rank receives the other half of w, 4 x 4 fp32 = 64 bytes, which is its bound
    assert {r: (e["sync_recv_bytes"], e["sync_send_bytes"], e["sync_bound_bytes"]) for r, e in per_rank(plan).items()} == {
        r: (64, 64, 64) for r in range(4)}
    dropped = copy.deepcopy(plan)
    lost = dropped.buckets[0].ops.pop(0)
    with pytest.raises(InvariantError, match=rf"^rank {lost.participants[0]}: the weight-sync plan leaves part of its "
                                             r"rollout shard of w unsent"):
        check_sync_cover(dropped)
    twice = copy.deepcopy(plan)
    twice.buckets[0].ops.append(copy.deepcopy(twice.buckets[0].ops[0]))
    with pytest.raises(InvariantError, match=r"^rank \d: the weight-sync plan gives it units \d-\d \(rows 0-4\) of w twice"):
        check_sync_cover(twice)


def test_checkpoint_piece_written_twice_names_the_rank():
    from megarl.tools.dryrun_checkpoint import Piece, check_written_once

    piece = Piece("actor/model.w", (0, 0), (2, 2), (2, 4), "float32", 16, (0, 0), False)
    with pytest.raises(InvariantError, match=r"^rank 3: writes checkpoint piece actor/model.w at \[0, 0\], which rank 1"):
        check_written_once({("actor/model.w", (0, 0)): [1, 3]}, {"actor/model.w": [piece]}, complete=False)
    with pytest.raises(InvariantError, match=r"checkpoint tensor actor/model.w: its pieces written by the ranks cover 4 of 8"):
        check_written_once({("actor/model.w", (0, 0)): [1]}, {"actor/model.w": [piece]}, complete=True)


def test_checkpoint_pieces_are_megatrons_own(tiny_moe_671b_models):
    """The optimizer pieces the dry run derives (dryrun_checkpoint.engine_pieces) are those Megatron's
    distributed optimizer builds for the save (fully_reshardable), on an MoE stage with experts."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megarl.config import load_config
    from megarl.engine.checkpointing import _sharded_state_dict
    from megarl.engine.engine import MegatronEngine
    from megarl.distributed.parallel import ParallelDims
    from megarl.platform import fake_world, init_platform
    from megarl.tools.dryrun_checkpoint import engine_pieces
    from megarl.step.engine_options import engine_config

    model = tiny_moe_671b_models["deepseek_v3"]
    cfg = load_config(TINY_CONFIG, TINY + [f"model.path={model}"])
    init_platform(force_cpu=True)
    fake_world.enter(5, 8)  # stage 1 of pp2, ep rank 1: the experts 4-7 of layers 2 and 3
    try:
        dims = ParallelDims(world_size=8, pp=2, ep=2).initialize()
        with fake_world.MetaAllocation():
            engine = MegatronEngine(str(model), dims, engine_config(cfg, "actor", 1), meta=True)
            pieces, _, problems = engine_pieces("actor", engine, dims.layout)
            state = _sharded_state_dict(engine, is_loading=False)
        apply_factories(state)
        real = sorted((t.key.split("optimizer.", 1)[-1].removeprefix("state."), tuple(t.global_offset), tuple(t.local_shape),
                       str(t.dtype).removeprefix("torch."), tuple(t.replica_id))
                      for t in nested_values(state) if isinstance(t, ShardedTensor))
    finally:
        fake_world.leave()
    ours = sorted((p.key.removeprefix("actor/").split("optimizer.", 1)[-1].removeprefix("state."), p.offset, p.shape, p.dtype,
                   p.replica_prefix + (dims.layout.coords(5).edp if p.expert else dims.layout.replica(5),)) for p in pieces)
    assert problems == [] and len(ours) > 100 and ours == real
