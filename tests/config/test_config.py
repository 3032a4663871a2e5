"""Config loading, overrides and validation (megarl.config)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megarl import config as C
from megarl.config import Config, ConfigError, check_resume_path, load_config, save_resolved, validate

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
# Enough to pass the required-value checks when loading from defaults.
BASE = ["model.path=/tmp/model", "data.train_files=[/tmp/train.parquet]"]


def test_there_are_shipped_configs():
    names = {p.name for p in SHIPPED}
    assert {"tiny_cpu.yaml", "qwen2.5-0.5b-gsm8k.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_loads_validates_and_round_trips(path, tmp_path):
    text = path.read_text()
    assert text.startswith("#"), "every shipped config starts with a header saying what it is for"
    header = text.split("\n\n")[0]
    assert any(f"launch/{entry}.py" in header for entry in ("ppo", "sft", "reward_model")), "the header says how to launch it"
    cfg = load_config(path)
    out = tmp_path / "resolved.yaml"
    save_resolved(cfg, out)
    assert load_config(out) == cfg


def test_tiny_cpu_layout_on_two_processes():
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml")
    sizes = validate(cfg, world_size=2)
    assert sizes.dp == 2 and sizes.prompts_per_dp_rank * 2 == cfg.data.prompts_per_step


def test_qwen_gsm8k_matches_the_verl_example():
    cfg = load_config(REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml")
    assert (cfg.actor.optim.lr, cfg.critic.optim.lr) == (1e-6, 1e-5)
    assert cfg.data.prompts_per_step == 256 and cfg.rollout.max_new_tokens == 512
    assert cfg.data.max_prompt_tokens == 512 and cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.rollout.engine == "vllm" and cfg.algorithm.adv_estimator == "gae"
    assert cfg.trainer.total_steps == 15 * (7473 // 256)
    validate(cfg, world_size=1)


def test_defaults_and_overrides_parse_as_yaml():
    cfg = load_config(None, BASE + ["actor.optim.lr=1e-6", "actor.use_kl_loss=true",
                                    "data.train_files=[a.parquet,b.parquet]", "parallel.etp=null",
                                    "trainer.resume=never", "critic.optim.betas=[0.9,0.95]"])
    assert cfg.actor.optim.lr == 1e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.actor.use_kl_loss is True
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.critic.optim.betas == (0.9, 0.95)
    assert cfg.trainer.resume == "never" and cfg.parallel.etp is None
    # Section defaults differ per section: the critic's lr is 1e-5 unless set.
    assert cfg.critic.optim.lr == 1e-5


def test_override_beats_file_and_partial_sections_keep_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"train_files": ["t"]},
                                    "critic": {"optim": {"weight_decay": 0.0}}, "trainer": {"total_steps": 7}}))
    cfg = load_config(path, ["trainer.total_steps=9", "data.train_files=one.parquet"])
    assert cfg.trainer.total_steps == 9
    assert cfg.data.train_files == ["one.parquet"]  # a scalar means a one-file list
    assert cfg.critic.optim.weight_decay == 0.0 and cfg.critic.optim.lr == 1e-5


@pytest.mark.parametrize("override, message", [
    ("actor.optm.lr=1e-6", "unknown config key 'actor.optm.lr'; did you mean 'actor.optim.lr'?"),
    ("trainer.gamma=0.9", "unknown config key 'trainer.gamma'; did you mean 'algorithm.gamma'?"),
    ("trainer.total_step=3", "did you mean 'trainer.total_steps'?"),
    ("rollout.n=4", "megarl's key is 'rollout.samples_per_prompt'"),
    ("parallel.tp=two", "parallel.tp: expected an integer, got 'two'"),
    ("parallel.tp=1.5", "parallel.tp: expected an integer, got 1.5"),
    ("actor.optim.lr=fast", "actor.optim.lr: expected a number, got 'fast'"),
    ("actor.use_kl_loss=maybe", "actor.use_kl_loss: expected true or false, got 'maybe'"),
    ("rollout.engine=trt", "rollout.engine: 'trt' is not one of hf, vllm, sglang"),
    ("algorithm.adv_estimator=ppo", "is not one of gae, grpo, rloo, reinforce_plus_plus, remax"),
    ("actor.clip_ratio=-0.1", "actor.clip_ratio must be > 0, got -0.1"),
    ("rollout.top_p=1.5", "rollout.top_p must be <= 1, got 1.5"),
    ("actor.optim=3", "actor.optim: expected a mapping, got 3"),
    ("no_equals_sign", "is not of the form key=value"),
])
def test_bad_overrides_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_key_in_yaml_names_the_full_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  optim:\n    lrr: 1.0e-6\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'\?"):
        load_config(path, BASE)


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping of config sections"):
        load_config(bad)


def test_cross_field_value_checks():
    with pytest.raises(ConfigError, match="model.path is required"):
        load_config(None, ["data.train_files=[a]"])
    with pytest.raises(ConfigError, match="data.train_files is empty"):
        load_config(None, ["model.path=m"])
    with pytest.raises(ConfigError, match=r"adv_estimator=grpo needs rollout.samples_per_prompt >= 2 .*got 1"):
        load_config(None, BASE + ["algorithm.adv_estimator=grpo"])
    with pytest.raises(ConfigError, match="reward.kind=function needs reward.function='module:function'"):
        load_config(None, BASE + ["reward.kind=function"])
    with pytest.raises(ConfigError, match=r"actor.optim.min_lr = 0.1 is above actor.optim.lr = 0.01"):
        load_config(None, BASE + ["actor.optim.lr=0.01", "actor.optim.min_lr=0.1"])
    # The disk is checked apart from validate(): loading succeeds, the input check names the problem.
    with pytest.raises(ConfigError, match="trainer.resume: '/no/such/ckpt' is neither auto, never nor"):
        check_resume_path(load_config(None, BASE + ["trainer.resume=/no/such/ckpt"]).trainer.resume)


def test_resume_path_must_be_a_complete_checkpoint(tmp_path):
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    with pytest.raises(ConfigError, match="step_00000010 has no COMPLETE marker"):
        check_resume_path(load_config(None, BASE + [f"trainer.resume={ckpt}"]).trainer.resume)
    (ckpt / "COMPLETE").write_text("")
    cfg = load_config(None, BASE + [f"trainer.resume={ckpt}"])
    check_resume_path(cfg.trainer.resume)
    assert cfg.trainer.resume == str(ckpt)


def test_layout_arithmetic_is_shown():
    cfg = load_config(None, BASE + ["parallel.tp=2", "parallel.pp=2"])
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp\*pp\*cp = 2\*2\*1 = 4"):
        validate(cfg, world_size=6)
    sizes = validate(cfg, world_size=8)
    assert (sizes.dp, sizes.prompts_per_dp_rank, sizes.responses_per_step) == (2, 128, 256)
    assert sizes.actor_responses_per_minibatch_per_dp_rank == 256 // (2 * 4)

    cfg = load_config(None, BASE + ["data.prompts_per_step=12", "rollout.samples_per_prompt=2",
                                    "actor.ppo_mini_batches=5"])
    with pytest.raises(ConfigError, match=r"data.prompts_per_step \* rollout.samples_per_prompt = 12 \* 2 = 24 "
                                          r"responses per step is not divisible by DP size \* actor.ppo_mini_batches "
                                          r"= 2 \* 5 = 10"):
        validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"data.prompts_per_step = 12 is not divisible by the data-parallel size 8"):
        validate(cfg, world_size=8)
    cfg = load_config(None, BASE + ["parallel.ep=4", "rollout.tp=3", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"world size 2 / pp 1 = 2 ranks per pipeline stage is not divisible by "
                                          r"etp\*ep = 1\*4 = 4"):
        validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"world size 4 is not divisible by rollout.tp = 3"):
        validate(cfg, world_size=4)


def test_config_built_in_code_gets_the_same_checks():
    cfg = Config()
    cfg.model.path, cfg.data.train_files = "m", ["t"]
    cfg.rollout.engine = "trt"
    with pytest.raises(ConfigError, match="rollout.engine: 'trt' is not one of"):
        validate(cfg)


def test_flatten_names_every_leaf_key():
    flat = C.flatten(load_config(None, BASE))
    assert set(flat) == set(C.all_keys())
    assert flat["actor.optim.lr"] == 1e-6 and flat["critic.optim.lr"] == 1e-5


def test_fixed_key_names_exist():
    """Docs and the launcher depend on these names."""
    fixed = """trainer.run_dir trainer.total_steps trainer.seed trainer.save_every_steps trainer.resume parallel.tp
    parallel.pp parallel.ep rollout.engine rollout.tp rollout.samples_per_prompt data.train_files data.prompts_per_step
    algorithm.adv_estimator algorithm.gamma algorithm.lam algorithm.use_kl_in_reward algorithm.kl_ctrl.type
    algorithm.kl_ctrl.kl_coef algorithm.kl_ctrl.target_kl algorithm.kl_ctrl.horizon actor.use_kl_loss
    actor.kl_loss_type actor.clip_ratio actor.clip_ratio_c actor.ppo_epochs actor.optim.lr actor.optim.max_grad_norm
    critic.vf_clip""".split()
    assert set(fixed) <= set(C.all_keys())


def test_enums_match_the_code_that_consumes_them():
    import typing

    from megarl.algorithms.kl import KL_KINDS_ALL
    from megarl.algorithms.losses import AGG_MODES
    from megarl.data.arithmetic import TASK_KINDS

    assert set(typing.get_args(C.KLKind)) == set(KL_KINDS_ALL) | {"full"}
    assert typing.get_args(C.LossAggMode) == AGG_MODES
    assert typing.get_args(typing.get_type_hints(C.ArithmeticDataConfig)["kind"]) == TASK_KINDS


def test_docs_are_generated_from_the_schema():
    docs = (REPO / "docs" / "configuration.md").read_text()
    assert docs.strip() == C.render_docs().strip(), \
        "docs/configuration.md is stale: python -m megarl.config --docs > docs/configuration.md"
