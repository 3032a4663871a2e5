"""rollout.placement / num_ranks and the `async` section: keys, round trip, one-line refusals."""
from __future__ import annotations

import pytest
import yaml

from megarl.config import ConfigError, load_config, save_resolved, validate

BASE = "configs/tiny_cpu.yaml"


def test_async_section_is_spelled_async_and_round_trips(tmp_path):
    cfg = load_config(BASE, ["rollout.placement=separate", "rollout.num_ranks=1", "async.max_staleness=2",
                             "async.partial_rollout=true"])
    assert (cfg.async_.max_staleness, cfg.async_.partial_rollout) == (2, True)
    save_resolved(cfg, tmp_path / "c.yaml")
    written = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert written["async"] == {"max_staleness": 2, "partial_rollout": True} and "async_" not in written
    assert load_config(tmp_path / "c.yaml").async_ == cfg.async_
    # the training ranks are the world less the rollout ranks: 3 processes -> dp 2
    assert validate(load_config(BASE, ["rollout.placement=separate", "rollout.num_ranks=1"]), 3).dp == 2


@pytest.mark.parametrize("overrides,message", [
    (["rollout.num_ranks=1"], "applies to rollout.placement=separate only"),
    (["async.max_staleness=1"], "set rollout.placement=separate"),
    (["rollout.placement=separate"], "needs rollout.num_ranks >= 1"),
    (["rollout.placement=separate", "rollout.num_ranks=1", "rollout.engine=sglang"], "runs rollout.engine=hf or vllm so far"),
    (["rollout.placement=separate", "rollout.num_ranks=2", "rollout.engine=vllm", "rollout.tp=2", "async.max_staleness=1",
      "async.partial_rollout=true"], "set rollout.tp=1 .* or async.partial_rollout=false"),
    (["rollout.placement=separate", "rollout.num_ranks=1", "async.partial_rollout=true"], "set async.max_staleness >= 1"),
    (["rollout.placement=separate", "rollout.num_ranks=1", "algorithm.adv_estimator=remax"], "use rollout.placement=colocated"),
    (["rollout.placement=separate", "rollout.num_ranks=1", "actor.routing_replay=true"],
     "set actor.routing_replay=false or rollout.placement=colocated"),
    (["async.max_stalenes=1"], "did you mean 'async.max_staleness'"),
    (["rollout.placement=separate", "rollout.num_ranks=1", "async.max_staleness=1", "algorithm.filter_groups.enable=true",
      "algorithm.adv_estimator=grpo"], "set async.max_staleness=0 or algorithm.filter_groups.enable=false"),
])
def test_refusals_name_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(BASE, overrides)


def test_partial_rollout_runs_on_vllm_engines_of_one_rank():
    cfg = load_config(BASE, ["rollout.placement=separate", "rollout.num_ranks=2", "rollout.engine=vllm",
                             "async.max_staleness=1", "async.partial_rollout=true"])
    assert (cfg.rollout.engine, cfg.rollout.tp, cfg.async_.partial_rollout) == ("vllm", 1, True)


def test_multi_turn_and_dynamic_sampling_run_under_separate_placement():
    separate = ["rollout.placement=separate", "rollout.num_ranks=1"]
    load_config("configs/tiny_cpu_tool.yaml", [*separate, "async.max_staleness=1"])  # episodes on the rollout rank
    load_config(BASE, [*separate, "algorithm.filter_groups.enable=true", "algorithm.adv_estimator=grpo"])  # at K = 0


def test_no_training_rank_left_is_refused():
    cfg = load_config(BASE, ["rollout.placement=separate", "rollout.num_ranks=2"])
    with pytest.raises(ConfigError, match="leaves no training rank in a world of 2"):
        validate(cfg, 2)
