"""megarl.layout, the one owner of layout arithmetic (issue 23, item 1): torch-free, hand-worked
stage layers and rank maps (and Megatron-Core's own rank generator), rollout refusals before any
model exists, and the planner reading the real Config."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from megarl.config import ConfigError, load_config, validate
from megarl.layout import ModelShape, ParallelLayout, RankCoords, check_model, check_rollout, rollout_blocks, stage_layers


def test_imports_without_torch():
    """Config validation, the planner and the layout module run with torch (and Megatron) unimportable."""
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        sys.modules["megatron"] = None
        from megarl.layout import ParallelLayout, check_model, ModelShape
        from megarl.config import load_config, validate
        from megarl.capacity import arch, estimate, from_config
        lay = ParallelLayout.for_world(16, tp=2, pp=2, cp=2)
        print(lay.dp, lay.stage_layer_counts(8), lay.coords(13))
        cfg = load_config("configs/tiny_cpu.yaml", ["parallel.tp=2"])
        print(validate(cfg, world_size=4).dp)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["2 [4, 4] RankCoords(pp=1, tp=1, dp=1, ep=0, cp=0, etp=1, edp=2)", "2"]


def test_stage_layers_hand_worked():
    # DeepSeek-V3's 61 layers over 16 stages: 3 on the first, 2 on the last, 56 / 14 = 4 on the others.
    assert [len(r) for r in stage_layers(61, 16, 3, 2)] == [3] + [4] * 14 + [2]
    assert stage_layers(7, 3, first=1) == [range(0, 1), range(1, 4), range(4, 7)]
    assert stage_layers(5, 1) == [range(5)]
    # pp2 x vpp2 over 8 layers: chunk v of every stage before chunk v + 1 (Megatron's offsets)
    lay = ParallelLayout(pp=2, vpp=2)
    assert lay.chunk_layers(8) == {(0, 0): range(0, 2), (1, 0): range(2, 4), (0, 1): range(4, 6), (1, 1): range(6, 8)}
    assert lay.layer_owner(5, 8) == (0, 1)
    # uneven and virtual: stage 0 holds 2 (one per chunk), stage 1 holds 4: chunk 0 = [0], [1, 2]; chunk 1 = [3], [4, 5]
    assert ParallelLayout(pp=2, vpp=2, first_stage_layers=2).chunk_layers(6) == {
        (0, 0): range(0, 1), (1, 0): range(1, 3), (0, 1): range(3, 4), (1, 1): range(4, 6)}
    with pytest.raises(ValueError, match=r"parallel layout world=2 tp=1 pp=2 vpp=2 cp=1 dp=1: pipeline stage 0 has 3 layers"):
        ParallelLayout(pp=2, vpp=2).stage_layers(6)  # 3 + 3 layers, each to cut into 2 chunks
    assert ParallelLayout(pp=2, vpp=1).vpp is None  # one virtual stage is plain 1F1B


def test_rank_map_hand_worked():
    # rank = tp + tp * (cp + cp * (dp + dp * pp)): with tp2 cp2 dp2 pp2, 13 = 1 + 2 * (0 + 2 * (1 + 2 * 1)).
    lay = ParallelLayout.for_world(16, tp=2, pp=2, cp=2)
    assert lay.dp == 2 and lay.model_parallel_size == 8
    c = lay.coords(13)
    assert (c.tp, c.cp, c.dp, c.pp) == (1, 0, 1, 1) and lay.rank_of(pp=1, tp=1, dp=1, cp=0) == 13
    assert lay.replica(13) == 0 + 2 * 1  # cp ranks are weight replicas: cp_rank + cp * dp_rank
    assert lay.model_parallel_ranks(dp=1, cp=1) == [6, 7, 14, 15]
    # experts over the tp x cp x dp = 8 ranks of a stage: etp 1, ep 4 -> expert dp 2; rank 13 is local 5
    moe = ParallelLayout.for_world(16, tp=2, pp=2, cp=2, ep=4, etp=1)
    assert moe.expert_dp == 2 and moe.coords(13) == RankCoords(pp=1, tp=1, dp=1, ep=1, cp=0, etp=0, edp=1)
    # cp = 1 keeps the HybridEngine's map: ep = dp % ep when etp = tp
    assert [ParallelLayout(tp=2, pp=1, dp=4, ep=2).coords(r).ep for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"world size 12 is not divisible by tp\*pp\*cp = 2\*2\*2 = 8"):
        ParallelLayout.for_world(12, tp=2, pp=2, cp=2)


LAYOUTS = [dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp) for tp, pp, cp, ep, etp in itertools.product((1, 2), (1, 2), (1, 2), (1, 2, 4), (None, 1))]


@pytest.mark.parametrize("world", [8, 16])
def test_rank_map_is_megatrons(world):
    """Every rank's coordinates place it in the groups Megatron-Core's RankGenerator builds
    (parallel_state.initialize_model_parallel, order tp-cp-ep-dp-pp; experts etp-ep-edp)."""
    from megatron.core.parallel_state import RankGenerator

    checked = 0
    for kw in LAYOUTS:
        try:
            lay = ParallelLayout.for_world(world, **kw)
        except ValueError:
            continue
        dense = RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order="tp-cp-ep-dp-pp")
        expert = RankGenerator(tp=lay.expert_tp, ep=lay.ep, dp=lay.expert_dp, pp=lay.pp, cp=1, order="tp-cp-ep-dp-pp")
        for gen, token, axis in ((dense, "tp", "tp"), (dense, "cp", "cp"), (dense, "dp", "dp"), (dense, "pp", "pp"),
                                 (expert, "tp", "etp"), (expert, "ep", "ep"), (expert, "dp", "edp")):
            for group in gen.get_ranks(token):
                coords = [lay.coords(r) for r in group]
                assert [getattr(c, axis) for c in coords] == list(range(len(group))), (kw, token, group)
                others = {tuple(v for k, v in vars(c).items() if k in ("tp", "cp", "dp", "pp") and k != axis) for c in coords}
                if gen is dense:
                    assert len(others) == 1, (kw, token, group)  # one group = one point of the other dense axes
        checked += 1
    assert checked >= 20


def test_model_rules_in_one_place():
    dense = ModelShape(name="llama", num_layers=4, heads=8, kv_heads=2, ffn=96)
    check_model(dense, ParallelLayout(tp=2, pp=2))
    with pytest.raises(ValueError, match="parallel.tp = 4 does not divide the model's 2 key/value heads"):
        check_model(dense, ParallelLayout(tp=4))
    moe = ModelShape(name="qwen3_moe", num_layers=4, heads=8, kv_heads=2, ffn=96, experts=4, moe_ffn=32)
    check_model(moe, ParallelLayout(tp=2, ep=2, dp=2))  # Megatron builds it (forward-only tools run it)
    with pytest.raises(ValueError, match="MoE training at tp > 1 needs sequence parallelism"):
        check_model(moe, ParallelLayout(tp=2, ep=2, dp=2), training=True)
    check_model(moe, ParallelLayout(tp=2, ep=2, dp=2, sequence_parallel=True), training=True)
    # tp 1 has nothing to split: the flag is normalised away
    assert ParallelLayout(ep=2, dp=2, sequence_parallel=True).sequence_parallel is False
    tied = ModelShape(name="llama", num_layers=4, heads=8, kv_heads=2, ffn=96, tie_embeddings=True)
    with pytest.raises(ValueError, match="parallel.vpp = 2 with a model whose embeddings are tied"):
        check_model(tied, ParallelLayout(pp=2, vpp=2), training=True)


def test_rollout_groups_and_refusals():
    assert rollout_blocks(4, 2) == [(0, 1), (2, 3)]
    check_rollout("vllm", 2, 4)
    with pytest.raises(ValueError, match=r"rollout.engine=hf runs one model per rank \(rollout.tp 1\), got rollout.tp=2"):
        check_rollout("hf", 2, 4)
    with pytest.raises(ValueError, match="world size 6 is not divisible by rollout.tp = 4"):
        rollout_blocks(6, 4)


def test_hf_rollout_tp2_is_a_config_error():
    cfg = load_config(str(REPO / "configs" / "tiny_cpu.yaml"), ["rollout.engine=vllm", "rollout.tp=2"])
    assert validate(cfg, world_size=2).dp == 2
    cfg.rollout.engine = "hf"
    with pytest.raises(ConfigError, match="rollout.engine=hf runs one model per rank"):
        validate(cfg, world_size=2)


def test_launcher_refuses_hf_rollout_tp2_before_any_model(tmp_path):
    """At world size 2 (rank 0 of two; the launcher checks the config before torch.distributed
    starts) `rollout.engine=hf rollout.tp=2` is one line, exit 2, and no model was made: it used to
    pass validation and fail in the rollout builder after the actor, critic and reference existed."""
    model = tmp_path / "model"
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = subprocess.run([sys.executable, "launch/ppo.py", "--config", "configs/tiny_cpu.yaml", "rollout.tp=2",
                           f"model.path={model}", f"trainer.run_dir={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().startswith("config error: rollout.engine=hf runs one model per rank")
    assert proc.stderr.strip().count("\n") == 0
    assert not model.exists() and not (tmp_path / "run").exists()


def test_planner_reads_the_config_with_the_schemas_defaults(tmp_path):
    """A config that omits rollout.max_new_tokens, data.max_prompt_tokens and
    actor.max_tokens_per_microbatch is planned as the run it is: with the schema's defaults."""
    from megarl.config.schema import Config
    from megarl.capacity.from_config import load_run_config, planner_inputs

    path = tmp_path / "run.yaml"
    path.write_text("model: {path: /models/qwen}\ndata: {train_files: [t.parquet], prompts_per_step: 64}\n"
                    "parallel: {tp: 2, pp: 2, vpp: 2, first_stage_layers: 2}\nrollout: {engine: vllm, tp: 4, samples_per_prompt: 8}\n")
    model, lay, run = planner_inputs(load_run_config(path))
    defaults = Config()
    assert (run.response_len, run.prompt_len, run.max_tokens_per_microbatch) == (512, 512, 16384)
    assert (run.response_len, run.prompt_len, run.max_tokens_per_microbatch) == (
        defaults.rollout.max_new_tokens, defaults.data.max_prompt_tokens, defaults.actor.max_tokens_per_microbatch)
    assert model == "/models/qwen" and (run.prompts_per_step, run.samples_per_prompt) == (64, 8)
    assert (lay.tp, lay.pp, lay.vpp, lay.first_stage_layers, lay.rollout_tp) == (2, 2, 2, 2, 4)
    assert run.critic and not run.ref  # the schema's adv_estimator (gae) and no KL
    path.write_text(path.read_text() + "actor: {max_tokens_per_micro_batch: 8}\n")
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        load_run_config(path)  # unknown keys are refused as the trainer refuses them


def test_compare_runs_is_bitwise_and_skips_timing(tmp_path):
    """tests/layouts/compare_runs.py, the refactor check: one ulp apart is a difference, timing is not."""
    import json
    import math

    from layouts.compare_runs import first_difference, load

    rows = [{"step": 1, "actor/pg_loss": 0.1, "timing_s/gen": 1.0, "perf/throughput": 5.0}]
    for name, loss, gen in (("a", 0.1, 1.0), ("b", 0.1, 2.0), ("c", math.nextafter(0.1, 1.0), 1.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({**rows[0], "actor/pg_loss": loss, "timing_s/gen": gen}) + "\n")
    assert first_difference(load(tmp_path / "a"), load(tmp_path / "b")) is None
    assert "actor/pg_loss" in first_difference(load(tmp_path / "a"), load(tmp_path / "c"))


def test_config_check_reads_config_json_with_the_builders_parser(tmp_path):
    """The launcher's model check parses config.json as the model builder does, so a model the
    builder refuses (here a family megarl does not build) is one config error before any process
    group or model exists (it used to be skipped there and fail inside the trainer)."""
    import json

    from megarl.config.inputs import check_model_layout

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    cfg = load_config(str(REPO / "configs" / "tiny_cpu.yaml"), [f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model_type 'gpt2' .* is not supported; supported families: llama"):
        check_model_layout(cfg)


def test_config_check_covers_the_critic_trunk(tmp_path):
    """critic.model_path is built on the same layout: its heads over tp are checked before any model."""
    import json

    from megarl.config.inputs import check_model_layout

    llama = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 301}
    for name, heads in (("actor", 4), ("critic", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**llama, "num_attention_heads": heads}))
    overrides = [f"model.path={tmp_path / 'actor'}", "parallel.tp=2", "algorithm.adv_estimator=gae", "rollout.samples_per_prompt=1"]
    check_model_layout(load_config(str(REPO / "configs" / "tiny_cpu.yaml"), overrides))
    cfg = load_config(str(REPO / "configs" / "tiny_cpu.yaml"), overrides + [f"critic.model_path={tmp_path / 'critic'}"])
    with pytest.raises(ConfigError, match=r"parallel.tp = 2 does not divide the model's 3 attention heads \(llama\) \(critic.model_path "):
        check_model_layout(cfg)
