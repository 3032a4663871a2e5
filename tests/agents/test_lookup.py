"""The tool demo's environment (megarl.agents.lookup) with the demo's stop token: a call turn that
ended on "?" (its text "", the stop token dropped) is a lookup, an answer that ended on "?" instead
of eos loses its score, and the config's stop id is the digits tokenizer's "?"."""
from __future__ import annotations

from megarl.agents.environment import Turn
from megarl.agents.lookup import ANSWER_WITHOUT_EOS, CALL_BONUS, CALL_TOKEN_ID, LookupTool, secret_value
from megarl.config import load_config
from megarl.rewards.decode import response_text
from megarl.tools.make_tiny_model import build_tokenizer


def test_a_turn_stopped_on_the_call_token_is_a_lookup(tmp_path):
    tok = build_tokenizer("digits", tmp_path)
    assert tok.convert_tokens_to_ids("?") == CALL_TOKEN_ID
    cfg = load_config("configs/tiny_cpu_tool.yaml", [])
    assert cfg.rollout.stop_token_ids == [CALL_TOKEN_ID]
    stop = (CALL_TOKEN_ID, tok.eos_token_id)

    env = LookupTool()
    env.reset({"prompt": "472="})
    call = (CALL_TOKEN_ID,)
    assert response_text(tok, call, stop) == ""  # what multi_turn hands the environment as turn.text
    assert env.step(Turn("", call, 0, "stop")) == (f"{secret_value('472')}:", CALL_BONUS, False)
    assert env.step(Turn("", call, 1, "stop")) == (f"{secret_value('472')}:", 0.0, False)  # bonus once
    answer = tuple(tok.encode("815", add_special_tokens=False)) + (tok.eos_token_id,)
    assert env.step(Turn(response_text(tok, answer, stop), answer, 2, "stop")) == (None, 0.0, True)
    # an answer ending on the call token reads like "815" eos to the reward (the final stop token
    # dropped): the environment takes the reward function's 1.0 back
    ended_on_call = tuple(tok.encode("815?", add_special_tokens=False))
    assert response_text(tok, ended_on_call, stop) == response_text(tok, answer, stop) == "815"
    assert env.step(Turn("815", ended_on_call, 2, "stop")) == (None, ANSWER_WITHOUT_EOS, True)
    # an eos-only turn is an (empty) answer, not a call; without the stop a "?..." turn still calls
    assert LookupTool().step(Turn("", (tok.eos_token_id,), 0, "stop"))[2] is True
    env = LookupTool()
    env.reset({"prompt": "472="})
    assert env.step(Turn("?83", tuple(tok.encode("?83", add_special_tokens=False)), 0, "length"))[1] == CALL_BONUS
