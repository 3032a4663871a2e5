"""The CPU tool demo's task (configs/tiny_cpu_tool.yaml): answer a key with its value in a table
only the environment holds, so the policy can only score by calling the lookup tool.

    prompt "472="   policy "?"   environment "815:"   policy "815" eos   (score 1.1)

The table is a keyed hash (`megarl.data.lookup_table`: `secret_value`, the rows), not something the policy sees: a held-out key's value
cannot be learned from the training keys (train and held-out keys are disjoint, `is_held_out`).
A turn starting with "?" is a lookup of the episode's key, answered "<value>:"; any other turn is
the final answer and ends the episode. `final_answer_score` (reward.kind=function) scores the text
after the response's last ":" with the arithmetic task's partial credit; the first lookup earns
the environment's CALL_BONUS. The observation ends in ":", not the prompt's "=": with "=" the
policy could not tell the answer's place from the lookup's and learned to look up twice (a run
of 67 steps: tool-call rate 1.0, exact match 0.0, every episode "?..." "815=" "?..."). Every
character is one token of the `digits` tokenizer.

The demo's config makes "?" a stop token (CALL_TOKEN_ID in rollout.stop_token_ids), as real tool
formats stop at the call's closing tag: the call turn is then exactly "?" (its text "", the stop
token dropped), so `LookupTool` also reads the call from the turn's token ids. Without the stop a
call turn ran on to max_tokens_per_turn ("?836"): nothing rewarded or punished the three extra
tokens, so they stayed random, sat between the key's value and the answer, and the answer, copied
from a fixed distance back, took a neighbouring digit instead (seed 2: exact match 0.66; the five
failures stored, each a babbling call and one digit miscopied). With "?" a stop token an answer
can also end on it ("541?"), and the reward's text cannot tell: decoding drops the final stop
token whichever it is, so "541?" scored as "541" eos and a run learned to end answers with "?"
(exact match 0.25; the five failures stored had every digit right). Such a turn earns
ANSWER_WITHOUT_EOS from the environment, cancelling the reward function's at most 1.0.
"""
from __future__ import annotations

from megarl.agents.environment import Environment, Turn
from megarl.data.lookup_table import secret_value
from megarl.rewards.arithmetic import arithmetic_score

# The digits tokenizer's "?" (megarl.tools.make_tiny_model: 4 special tokens, then "0123456789+-*=;:?# ").
CALL_TOKEN_ID = 20
CALL_BONUS = 0.1  # the environment's reward for an episode's first lookup
ANSWER_WITHOUT_EOS = -1.0  # an answer turn that ended on the call token, not eos (module doc)


class LookupTool(Environment):
    """A turn "?..." is answered with "<value>:"; any other turn ends the episode (one ending on
    the call token, not eos, with ANSWER_WITHOUT_EOS). The first
    lookup earns CALL_BONUS: at the random start about one sample in twenty calls, and without the
    bonus the copy that would make calling pay is learned too rarely to pull it up (measured: the
    call rate fell from 0.05 to 0.02 over 28 steps while the score rose by guessing)."""

    def reset(self, row: dict) -> None:
        self.key, self.calls = row["prompt"].rstrip("="), 0
        return None

    def step(self, turn: Turn) -> tuple[str | None, float, bool]:
        if turn.text.startswith("?") or turn.token_ids[:1] == (CALL_TOKEN_ID,):
            self.calls += 1
            return f"{secret_value(self.key)}:", CALL_BONUS if self.calls == 1 else 0.0, False
        if turn.token_ids[-1:] == (CALL_TOKEN_ID,):
            return None, ANSWER_WITHOUT_EOS, True
        return None, 0.0, True


def final_answer_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Partial credit (megarl.rewards.arithmetic) of the text after the response's last ":"."""
    return arithmetic_score(solution_str.rsplit(":", 1)[-1], ground_truth)
