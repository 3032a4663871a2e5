"""A run whose banned tokens hold about half the probability mass (issue 21, item 1; gpu-paths F6): the
post-sync check (rollout.verify_weights, float32 limits) passes on correct weights, the rollout and
actor token probabilities agree, and the logged entropy is over the allowed vocabulary."""
from __future__ import annotations

import math

import pytest

from ppo_helpers import launch_ok, read_metrics, small_run_overrides

pytestmark = [pytest.mark.slow]  # one process, one PPO step with a critic: about a minute


def test_a_run_whose_bans_hold_half_the_mass_passes_the_sync_check(tmp_path):
    # The demo's 23-token vocabulary: <pad> <bos> <eos> <unk>, digits 4-13, then 9 symbols. Banning all but
    # <eos> and the digits removes 12 of 23 tokens, about half the mass of the (near-uniform) random model:
    # a full-vocabulary actor differs from vLLM's and SGLang's log-probs (banned mass removed) by
    # -log(1 - 0.52) = 0.7 per token, and its entropy is about log(23) (what this test saw before).
    banned = [0, 1, 3, *range(14, 23)]
    run_dir = tmp_path / "run"
    launch_ok(0, small_run_overrides(tmp_path, run_dir, **{
        "trainer.total_steps": 1, "rollout.banned_token_ids": f"[{','.join(map(str, banned))}]",
        "rollout.verify_weights": "true", "algorithm.use_kl_in_reward": "true"}))
    step = read_metrics(run_dir)[0]
    assert step["training/rollout_probs_diff_max"] < 1e-5
    allowed = 23 - len(banned)
    assert math.log(allowed) - 0.1 < step["actor/entropy"] <= math.log(allowed) + 1e-4  # not log(23) = 3.1
    # the reference's log-probs leave the banned mass out too: before any update it is the actor's policy
    assert abs(step["actor/reward_kl_penalty"]) < 1e-7
