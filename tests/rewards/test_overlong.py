"""DAPO's soft overlong penalty, hand-worked at the buffer's edges (megarl.rewards.overlong)."""
from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config, validate
from megarl.rewards.overlong import overlong_penalty

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


@pytest.mark.parametrize("length,expected", [
    (0, 0.0), (15, 0.0),          # up to and including L_max - L_buf = 20 - 5 = 15: no penalty
    (16, -0.2), (18, -0.6),       # -(len - 15) / 5 * 1.0
    (19, -0.8), (20, -1.0),       # -penalty_factor at L_max
    (23, -1.0),                   # past L_max (never produced by the engines) held at -penalty_factor
])
def test_penalty_at_the_buffer_edges(length, expected):
    assert overlong_penalty(length, max_len=20, buffer_len=5, penalty_factor=1.0) == pytest.approx(expected, abs=1e-12)


def test_penalty_factor_scales_and_zero_buffer_is_off():
    assert overlong_penalty(20, max_len=20, buffer_len=4, penalty_factor=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(17, max_len=20, buffer_len=4, penalty_factor=0.5) == pytest.approx(-0.125)  # -(17-16)/4*0.5
    assert overlong_penalty(20, max_len=20, buffer_len=0, penalty_factor=1.0) == 0.0
    # the buffer may be the whole length: every token costs penalty_factor / L_max
    assert overlong_penalty(1, max_len=20, buffer_len=20, penalty_factor=1.0) == pytest.approx(-0.05)
    assert overlong_penalty(0, max_len=20, buffer_len=20, penalty_factor=1.0) == 0.0
    # a penalty of zero is exactly 0.0, not -0.0 (counted as unpenalised)
    assert str(overlong_penalty(15, max_len=20, buffer_len=5, penalty_factor=1.0)) == "0.0"


def test_buffer_longer_than_the_response_limit_is_refused():
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer.len = 5 is longer than rollout.max_new_tokens = 4"):
        validate(load_config(TINY, ["reward.overlong_buffer.len=5"]))  # tiny_cpu's max_new_tokens is 4


def test_dynamic_sampling_needs_groups():
    overrides = ["algorithm.filter_groups.enable=true", "rollout.samples_per_prompt=1", "algorithm.adv_estimator=gae"]
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups.enable .* rollout.samples_per_prompt >= 2"):
        validate(load_config(TINY, overrides))
