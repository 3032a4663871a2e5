"""A user's environment, written outside the repository (a tmp directory on PYTHONPATH), plugs
into launch/ppo.py with the config line alone; under tensor parallelism (2 ranks sharing each
batch's episodes) the run trains on multi-turn samples whose policy tokens the trainer scores
exactly as the engine sampled them (the post-sync check, float32), and an environment that raises
or sleeps forever costs an observation and one timeout, not the run."""
from __future__ import annotations

import json
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


# The tool demo's environment, except that every first turn is a lookup: the random-initialised
# policy calls the tool about once in twenty samples, this way every episode has an observation.
FIRST_TURN_LOOKS_UP = textwrap.dedent('''
    from megarl.agents.lookup import CALL_BONUS, LookupTool, secret_value

    class FirstTurnLooksUp(LookupTool):
        def step(self, turn):
            if turn.index == 0:
                self.calls += 1
                return f"{secret_value(self.key)}:", CALL_BONUS, False
            return super().step(turn)
''')
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/entropy",
            "agents/env_token_fraction", "agents/env_reward_mean", "training/sync_logprob_diff_max")


def test_tool_demo_under_separate_placement_at_k1(tmp_path):
    """Issue 25 under issue 24's placement: 1 training + 1 rollout rank, async.max_staleness=1 with
    partial rollout; the rollout rank runs the episodes beside its engine. Step 1 (the initial
    weights, as at K = 0) logs what one colocated process logs; step 2 trains episodes one version
    old, some continued across the weight update, their observation tokens masked."""
    from megarl.data.lookup_table import lookup_rows
    from megarl.data.prepare import write_parquet

    envs = tmp_path / "outside"
    envs.mkdir()
    (envs / "first_lookup.py").write_text(FIRST_TURN_LOOKS_UP)
    write_parquet(lookup_rows(64, "train", 3), tmp_path / "train.parquet")
    shrunk = {"model.path": tmp_path / "model", "data.train_files": f"[{tmp_path / 'train.parquet'}]", "data.val_files": "[]",
              "rollout.multi_turn.environment": "first_lookup:FirstTurnLooksUp", "data.prompts_per_step": 4,
              "rollout.samples_per_prompt": 4, "actor.ppo_mini_batches": 2, "actor.ppo_epochs": 1, "trainer.total_steps": 2,
              "trainer.val_every_steps": 0, "trainer.save_every_steps": 0, "tracking.loggers": "[jsonl]",
              "tracking.progress_bar": "false"}
    overrides = lambda run, **extra: [f"{k}={v}" for k, v in {**shrunk, "trainer.run_dir": tmp_path / run, **extra}.items()]  # noqa: E731
    env = {"PYTHONPATH": f"{REPO}:{envs}"}
    launch_ok(0, overrides("colocated"), config="configs/tiny_cpu_tool.yaml", env=env)
    launch_ok(2, overrides("k1", **{"rollout.placement": "separate", "rollout.num_ranks": 1, "async.max_staleness": 1,
                                    "async.partial_rollout": "true", "tracking.sample_ids": "true"}),
              config="configs/tiny_cpu_tool.yaml", env=env)
    colocated, k1 = read_metrics(tmp_path / "colocated"), read_metrics(tmp_path / "k1")
    assert [r["step"] for r in colocated] == [r["step"] for r in k1] == [1, 2]
    for key in COMPARED:
        assert k1[0][key] == pytest.approx(colocated[0][key], rel=1e-3, abs=1e-9), key
    for row in colocated + k1:
        # every episode called the tool: observation tokens (mask 0) in every sample
        assert row["agents/tool_call_rate"] == 1.0 and row["agents/turns_mean"] == 2.0
        assert 0.2 < row["agents/env_token_fraction"] < 0.6
    # the policy's tokens, over sequences with the environment's holes, scored as sampled (the
    # initial weights: the post-sync check runs; step 2's samples are older than the weights)
    assert colocated[0]["training/sync_logprob_diff_max"] < 1e-5
    assert k1[0]["async/staleness_max"] == 0 and k1[1]["async/staleness_max"] == 1
    assert k1[1]["async/dropped_stale"] == 0
    steps = {json.loads(line)["step"]: json.loads(line)["samples"] for line in (tmp_path / "k1" / "samples.jsonl").read_text().splitlines()}
    assert all(set(r[3]) == {0} for r in steps[1])  # each token's policy version (environment tokens: the turn's before)
    assert all(set(r[3]) <= {0, 1} and r[3][0] == 0 for r in steps[2])
