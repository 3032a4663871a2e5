"""A user's environment, written outside the repository (a tmp directory on PYTHONPATH), plugs
into launch/ppo.py with the config line alone; under tensor parallelism (2 ranks sharing each
batch's episodes) the run trains on multi-turn samples whose policy tokens the trainer scores
exactly as the engine sampled them (the post-sync check, float32), and an environment that raises
or sleeps forever costs an observation and one timeout, not the run."""
from __future__ import annotations

import textwrap

import pytest

from conftest import REPO
from ppo_helpers import launch_ok, read_metrics, small_run_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

USER_ENV = textwrap.dedent('''
    import itertools
    import threading
    import megarl.agents

    CREATED = itertools.count()

    class Echo(megarl.agents.Environment):
        """Echoes the key after "="; done after the second turn. Of every 16 instances a rank
        creates (its share of a step's episodes), the first one's first step raises and the
        second one's never returns."""

        def reset(self, row):
            self.key, self.id, self.n = row["prompt"].rstrip("="), next(CREATED), 0

        def step(self, turn):
            self.n += 1
            if self.n == 1 and self.id % 16 == 0:
                raise RuntimeError("tool crashed")
            if self.n == 1 and self.id % 16 == 1:
                threading.Event().wait()
            return "=" + self.key, 0.25, self.n == 2
''')


def test_user_environment_multi_turn_run(tmp_path):
    envs = tmp_path / "outside"
    envs.mkdir()
    (envs / "user_echo_env.py").write_text(USER_ENV)
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(tmp_path, run_dir, **{
        "rollout.multi_turn.environment": "user_echo_env:Echo", "rollout.multi_turn.max_turns": 3,
        "rollout.multi_turn.max_tokens_per_turn": 4, "rollout.multi_turn.timeout_s": 1, "rollout.max_new_tokens": 48,
        "parallel.tp": 2, "trainer.total_steps": 1, "actor.ppo_epochs": 1, "algorithm.adv_estimator": "grpo", "tracking.loggers": "[jsonl]"})
    launch_ok(2, overrides, env={"PYTHONPATH": f"{REPO}:{envs}"})
    rows = read_metrics(run_dir)
    assert len(rows) == 1
    for r in rows:
        assert r["agents/tool_call_rate"] == 1.0  # every episode has an observation: the echo or a failure's text
        # 32 episodes, 16 per rank: one raised and one hung on each; counted, and the run went on
        assert r["agents/env_errors"] == 2 and r["agents/env_timeouts"] == 2
        assert 1.0 < r["agents/turns_mean"] <= 2.0 and 0.0 < r["agents/env_token_fraction"] < 1.0
        # the environment's reward reached the score: 0.25 per answered step, 0.25 or 0.5 per episode
        assert 0.25 <= r["agents/env_reward_mean"] <= 0.5 and r["critic/score/max"] >= 0.25
        # the actor's log-probs of the policy's tokens, over sequences with environment holes, are the
        # engine's (first sync of the run: fatal over the float32 limit)
        assert r["training/sync_logprob_diff_max"] < 1e-5
