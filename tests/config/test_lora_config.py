"""actor.lora / critic.lora in the config: defaults off, one-line refusals (targets the model lacks),
checkpoints of split adapters accepted, and the engine options the trainer builds from them."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO
from megarl.config import ConfigError, load_config, validate
from megarl.config.inputs import check_model_layout

sys.path.insert(0, str(REPO / "tests" / "capacity"))
from hf_configs import QWEN3_235B, QWEN25_7B  # noqa: E402

BASE = ["model.path=m", "data.train_files=[t.parquet]"]


def test_lora_is_off_by_default_and_reaches_the_engines():
    from megarl.step.engine_options import engine_config

    cfg = load_config(None, BASE)
    assert cfg.actor.lora.rank == 0 and cfg.critic.lora.rank == 0 and engine_config(cfg, "actor", 10).lora is None
    cfg = load_config(None, BASE + ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.target_modules=[q_proj,v_proj]",
                                    "critic.lora.rank=4", "trainer.seed=3"])
    actor, critic = engine_config(cfg, "actor", 10).lora, engine_config(cfg, "critic", 10).lora
    assert (actor.rank, actor.scale, actor.target_modules, actor.seed, actor.key) == (8, 2.0, ("q_proj", "v_proj"), 3, "actor.lora")
    assert (critic.rank, critic.target_modules, critic.key) == (4, None, "critic.lora")
    assert engine_config(cfg, "ref", 10).lora is None


@pytest.mark.parametrize("overrides,message", [
    (["actor.lora.rank=8", "actor.lora.target_modules=[]"], "actor.lora.target_modules is empty"),
    (["actor.lora.rank=-1"], "actor.lora.rank"),
])
def test_bad_lora_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(load_config(None, BASE + overrides))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"], ["parallel.tp=2", "parallel.etp=2"]])
def test_split_adapters_validate_with_and_without_checkpoints(layout):
    # adapter checkpoints describe the TP-split factors (megarl.engine.adapter_checkpoint): no refusal
    # (resumed at tp2 and tp2 x ep2: tests/trainer/test_lora_runs.py; across layouts: tests/engine/test_engine.py)
    for save in ("0", "5"):
        validate(load_config(None, BASE + ["actor.lora.rank=8", "critic.lora.rank=8", f"trainer.save_every_steps={save}", *layout]),
                 world_size=2)


@pytest.mark.parametrize("hf,overrides,message", [
    (QWEN25_7B, ["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,w1]"],
     "actor.lora.target_modules: w1 not in this qwen2 model; choose from q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    (QWEN3_235B, ["critic.lora.rank=8", "critic.lora.target_modules=[kv_b_proj]"], "critic.lora.target_modules: kv_b_proj not in"),
])
def test_targets_the_model_lacks_are_refused_at_start_up(tmp_path, hf, overrides, message):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = load_config(None, [f"model.path={tmp_path}", "data.train_files=[t.parquet]", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_model_layout(cfg)
    # the experts' projections are targets of a MoE model
    ok = load_config(None, [f"model.path={tmp_path}", "data.train_files=[t.parquet]", "actor.lora.rank=8",
                            "actor.lora.target_modules=[q_proj,down_proj]"])
    check_model_layout(ok)
