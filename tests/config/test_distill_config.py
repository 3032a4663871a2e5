"""algorithm.distill's bad inputs: one line naming the key and the fix, before any model is built."""
from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.config.inputs import check_model_layout, check_model_path
from megarl.tools.make_tiny_model import make_tiny_model

BASE = ["model.path=/tmp/model", "data.train_files=[/tmp/train.parquet]"]


def test_no_task_reward_needs_a_teacher_and_no_group_filter():
    with pytest.raises(ConfigError, match=r"reward.kind=none .* set algorithm.distill.teacher_path="):
        validate(load_config(None, BASE + ["reward.kind=none"]))
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable .* reward.kind=none"):
        validate(load_config(None, BASE + ["reward.kind=none", "algorithm.distill.teacher_path=/t",
                                           "algorithm.filter_groups.enable=true", "rollout.samples_per_prompt=4"]))
    cfg = load_config(None, BASE + ["reward.kind=none", "algorithm.distill.teacher_path=/t", "algorithm.distill.mode=loss"])
    validate(cfg)
    assert (cfg.algorithm.distill.coef, cfg.algorithm.distill.mode) == (1.0, "loss")
    with pytest.raises(ConfigError, match="algorithm.distill.mode"):
        load_config(None, BASE + ["algorithm.distill.mode=kl"])


def test_teacher_must_be_a_model_directory_with_the_students_vocabulary(tmp_path):
    student = make_tiny_model("llama", tmp_path / "student", tokenizer="digits", hidden=32, intermediate=64, layers=1,
                              heads=2, kv_heads=1)
    cfg = load_config(None, [f"model.path={student}", "data.train_files=[/tmp/train.parquet]",
                             f"algorithm.distill.teacher_path={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match=r"^algorithm.distill.teacher_path: .*nowhere is not a Hugging Face model directory"):
        check_model_path(cfg)
    other = make_tiny_model("llama", tmp_path / "other_vocab", vocab_size=301, hidden=32, intermediate=64, layers=2,
                            heads=2, kv_heads=1)
    cfg = load_config(None, [f"model.path={student}", "data.train_files=[/tmp/train.parquet]",
                             f"algorithm.distill.teacher_path={other}"])
    check_model_path(cfg)
    with pytest.raises(ConfigError, match=r"teacher's vocabulary has 301 tokens, the student's \(model.path\) \d+"):
        check_model_layout(cfg)
    # a larger teacher (3 layers, wider) with the student's tokenizer passes
    bigger = make_tiny_model("llama", tmp_path / "bigger", tokenizer="digits", hidden=64, intermediate=128, layers=3,
                             heads=4, kv_heads=2)
    check_model_layout(load_config(None, [f"model.path={student}", "data.train_files=[/tmp/train.parquet]",
                                          f"algorithm.distill.teacher_path={bigger}"]))
