"""What the reward sees (issue 11, item 1): special tokens inside a response stay visible; only the
stop token that ended it is dropped. Hand-worked on the demo's digits tokenizer."""
from __future__ import annotations

import pytest

from megarl.rewards import arithmetic_score
from megarl.rewards.decode import check_token_ids, response_text


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from megarl.tools.make_tiny_model import build_tokenizer

    return build_tokenizer("digits", tmp_path_factory.mktemp("digits"))


def test_a_pad_inside_the_answer_is_seen_and_costs_reward(digits):
    pad, eos = digits.pad_token_id, digits.eos_token_id
    four, seven, two = (digits.convert_tokens_to_ids(c) for c in "472")
    hacked = response_text(digits, [four, seven, pad, two], [eos])
    assert hacked == "47<pad>2"  # skip_special_tokens=True made this "472", worth the full 1.0
    assert arithmetic_score(hacked, "472") == pytest.approx(2 / 8)
    honest = response_text(digits, [four, seven, two, eos], [eos])
    assert honest == "472" and arithmetic_score(honest, "472") == 1.0


def test_only_the_final_stop_token_is_dropped(digits):
    eos, bos = digits.eos_token_id, digits.bos_token_id
    four = digits.convert_tokens_to_ids("4")
    assert response_text(digits, [four, eos, four, eos], [eos]) == "4<eos>4"
    assert response_text(digits, [bos, four], [eos]) == "<bos>4"  # length-capped: nothing dropped
    assert response_text(digits, [], [eos]) == ""


def test_token_ids_outside_the_vocabulary_are_named():
    check_token_ids("rollout.banned_token_ids", [0, 22], vocab_size=23)
    with pytest.raises(ValueError, match=r"rollout.banned_token_ids: token ids \[23, 99\] are outside .*0 \.\. 22"):
        check_token_ids("rollout.banned_token_ids", [99, 0, 23], vocab_size=23)
