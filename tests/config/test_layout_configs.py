"""Issue 14's layout keys (parallel.vpp, first_stage_layers, last_stage_layers, etp) in config
validation, and the 671B-class configs loaded and validated at the world size they are written for,
against their models' real config.json dimensions (tests/capacity/hf_configs.py)."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO
from megarl.config import ConfigError, load_config, validate
from megarl.config.inputs import check_model_layout

sys.path.insert(0, str(REPO / "tests" / "capacity"))
from hf_configs import DEEPSEEK_V3, GLM45, QWEN3_235B  # noqa: E402

BASE = ["model.path=m", "data.train_files=[t.parquet]"]

# config file -> (model config.json, intended world size: 32 nodes of 8 GPUs)
CONFIGS = {"deepseek-v3-671b.yaml": (DEEPSEEK_V3, 256), "glm-4.5-355b.yaml": (GLM45, 256),
           "qwen3-235b-a22b.yaml": (QWEN3_235B, 256)}


def _model_dir(tmp_path, hf: dict):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return str(tmp_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_671b_class_configs_validate_at_their_world_size(name, tmp_path):
    hf, world = CONFIGS[name]
    cfg = load_config(str(REPO / "configs" / name), [f"model.path={_model_dir(tmp_path, hf)}"])
    sizes = validate(cfg, world_size=world)
    p = cfg.parallel
    assert sizes.dp == world // (p.tp * p.pp)
    check_model_layout(cfg)  # heads over tp, layers over the (uneven, virtual) stages, experts over ep / etp
    # uneven end stages: every published layout needs them, as the layer counts do not divide
    assert hf["num_hidden_layers"] % p.pp != 0 and p.first_stage_layers is not None
    with pytest.raises(ConfigError, match="world size"):
        validate(cfg, world_size=world // 2 + 1)


def test_vpp_and_uneven_stages_are_validated():
    assert validate(load_config(None, BASE + ["parallel.pp=2", "parallel.vpp=2"]), world_size=4).dp == 2
    with pytest.raises(ConfigError, match=r"parallel.vpp = 2 needs parallel.pp > 1"):
        validate(load_config(None, BASE + ["parallel.vpp=2"]))
    with pytest.raises(ConfigError, match=r"parallel.first_stage_layers = 3 needs parallel.pp > 1"):
        validate(load_config(None, BASE + ["parallel.first_stage_layers=3"]))
    with pytest.raises(ConfigError, match=r"parallel.first_stage_layers must be >= 1, got 0"):
        validate(load_config(None, BASE + ["parallel.pp=2", "parallel.first_stage_layers=0"]))


@pytest.mark.parametrize("overrides,message", [
    # DeepSeek-V3's 61 layers: the even split and a wrong uneven one show the arithmetic
    (["parallel.first_stage_layers=null", "parallel.last_stage_layers=null"],
     "61 layers do not split over pp=16: first stage None, last stage None, 61 layers left for 16 stages"),
    (["parallel.last_stage_layers=3"], "55 layers left for 14 stages"),
    (["parallel.vpp=2"], "pipeline stage 0 has 3 layers, not divisible by vpp=2"),
    (["parallel.ep=48"], "parallel.ep = 48 does not divide the model's 256 routed experts"),
    (["parallel.tp=3"], "parallel.tp = 3 does not divide the model's 128 attention heads"),
])
def test_model_layout_errors_name_the_arithmetic(tmp_path, overrides, message):
    cfg = load_config(str(REPO / "configs" / "deepseek-v3-671b.yaml"), [f"model.path={_model_dir(tmp_path, DEEPSEEK_V3)}", *overrides])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        check_model_layout(cfg)
    assert str(err.value).count("\n") == 0


def test_vpp_with_tied_embeddings_is_refused(tmp_path):
    tied = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 301, "tie_word_embeddings": True}
    cfg = load_config(None, [f"model.path={_model_dir(tmp_path, tied)}", "data.train_files=[t]", "parallel.pp=2", "parallel.vpp=2"])
    with pytest.raises(ConfigError, match="parallel.vpp = 2 with a model whose embeddings are tied"):
        check_model_layout(cfg)
    cfg.parallel.vpp = None
    check_model_layout(cfg)  # 4 layers over pp2: fine without virtual stages


def test_expert_width_over_etp(tmp_path):
    # GLM-4.5's experts are 1536 wide: etp=5 cannot split them.
    cfg = load_config(str(REPO / "configs" / "glm-4.5-355b.yaml"), [f"model.path={_model_dir(tmp_path, GLM45)}", "parallel.etp=5"])
    with pytest.raises(ConfigError, match="parallel.etp = 5 does not divide the model's 1536 expert ffn width"):
        check_model_layout(cfg)
