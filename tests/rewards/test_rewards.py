"""Rule rewards, user reward functions and the factory (megarl.rewards)."""
from __future__ import annotations

import sys

import pytest

from megarl.config import ConfigError, RewardConfig
from megarl.rewards import (RuleReward, UserFunctionReward, arithmetic_score, build_reward_fn, extract_answer,
                            gsm8k_score)


def test_arithmetic_partial_credit_per_position():
    assert arithmetic_score("472", "472") == 1.0
    assert arithmetic_score("4725", "472") == 0.75  # too long: 3 of 4 positions
    assert arithmetic_score("47", "472") == pytest.approx(2 / 3)  # stopped early
    assert arithmetic_score("972", "472") == pytest.approx(2 / 3)
    assert arithmetic_score("", "472") == 0.0


def test_arithmetic_whitespace_is_a_character():
    # "472 " is what a policy truncated at max_new_tokens=4 answers when it emits a space where eos
    # belongs: it must not score like "472" + eos (the demo's GAE run learned exactly that hack).
    assert arithmetic_score("472 ", "472") == 0.75
    assert arithmetic_score(" 472", "472") == 0.0  # every position shifted
    assert arithmetic_score("47 ", "472") == pytest.approx(2 / 3)


@pytest.mark.parametrize("response, strict, flexible", [
    ("3 + 4 = 7, so 72 #### 72", 1.0, 1.0),
    ("#### 1,234", 0.0, 0.0),  # wrong answer (ground truth 72)
    ("The answer is 72.", 0.0, 1.0),  # no '####': strict finds nothing; verl's flexible misses the '.'
    ("#### $72", 1.0, 1.0),
    ("#### 72.0", 1.0, 1.0),  # compared as numbers
    ("no number here", 0.0, 0.0),
    ("#### 71 then #### 72", 1.0, 1.0),  # the last answer counts
])
def test_gsm8k_strict_and_flexible(response, strict, flexible):
    assert gsm8k_score(response, "72", "strict") == strict
    assert gsm8k_score(response, "72", "flexible") == flexible


def test_gsm8k_format_score_and_extraction():
    assert gsm8k_score("#### 5", "72", format_score=0.1) == 0.1  # well formed, wrong
    assert gsm8k_score("five", "72", format_score=0.1) == 0.0  # no answer at all
    assert extract_answer("#### -1,000") == "-1000"
    assert extract_answer("it is 12. Then 13.", "flexible") == "13."
    assert extract_answer("x" * 1000 + "#### 5") == "5"  # only the tail is searched


def test_auto_picks_the_rule_from_the_data_source():
    fn = build_reward_fn(RewardConfig(kind="auto"))
    scores = fn(["q", "472="], ["#### 72", "470"], ["72", "472"], ["openai/gsm8k", "arithmetic/copy"], [{}, {}])
    assert scores == [1.0, pytest.approx(2 / 3)]
    with pytest.raises(ValueError, match="no rule reward for data_source 'mystery'"):
        fn(["q"], ["a"], ["a"], ["mystery"], [{}])
    assert isinstance(build_reward_fn(RewardConfig(kind="gsm8k")).inner, RuleReward)


def _write_module(tmp_path, monkeypatch, body: str, name: str = "my_reward_mod"):
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return tmp_path / f"{name}.py"


def test_user_function_by_module_and_by_file(tmp_path, monkeypatch):
    path = _write_module(tmp_path, monkeypatch, (
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth) + extra_info.get('bonus', 0)}\n"))
    for spec in ("my_reward_mod:compute_score", f"{path}:compute_score"):
        fn = build_reward_fn(RewardConfig(kind="function", function=spec))
        assert isinstance(fn.inner, UserFunctionReward)
        assert fn(["p", "p"], ["a", "b"], ["a", "a"], ["s", "s"], [{}, {"bonus": 0.5}]) == [1.0, 0.5]


def test_user_function_errors_name_what_is_missing(tmp_path, monkeypatch):
    _write_module(tmp_path, monkeypatch, "def score(**kw):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"cannot import 'no_such_reward_module' \(ModuleNotFoundError"):
        build_reward_fn(RewardConfig(kind="function", function="no_such_reward_module:f"))
    with pytest.raises(ConfigError, match=r"module 'my_reward_mod' has no function 'compute_score' "
                                          r"\(callables there: score\)"):
        build_reward_fn(RewardConfig(kind="function", function="my_reward_mod:compute_score"))
    with pytest.raises(ConfigError, match="cannot import '/nope/r.py'"):
        build_reward_fn(RewardConfig(kind="function", function="/nope/r.py:f"))
    with pytest.raises(ConfigError, match="expected 'module:function'"):
        build_reward_fn(RewardConfig(kind="function", function="just_a_module"))


def test_reward_model_is_handed_in_by_the_trainer():
    def model(prompts, responses, ground_truths, data_sources, extras):
        return [0.5] * len(responses)

    assert build_reward_fn(RewardConfig(kind="model", model_path="rm"), reward_model=model).inner is model
    with pytest.raises(ConfigError, match="the trainer must build the reward model"):
        build_reward_fn(RewardConfig(kind="model", model_path="rm"))
