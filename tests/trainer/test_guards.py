"""Guard decisions: each fires only when configured and past its threshold, and says why."""
from __future__ import annotations

from megarl.config import GuardsConfig
from megarl.step.guards import Guards


def test_kl_guard_raises_coef_or_skips_update():
    off = Guards(GuardsConfig()).before_update(rollout_kl=10.0)
    assert not (off.raise_kl_coef or off.skip_actor_update or off.events)
    raise_ = Guards(GuardsConfig(kl_threshold=0.1)).before_update(rollout_kl=0.2)
    assert raise_.raise_kl_coef and not raise_.skip_actor_update
    assert raise_.events == [("guard/kl", {"kl": 0.2, "threshold": 0.1, "action": "raise_coef"})]
    skip = Guards(GuardsConfig(kl_threshold=0.1, kl_action="skip_update")).before_update(rollout_kl=0.2)
    assert skip.skip_actor_update and not skip.raise_kl_coef
    assert not Guards(GuardsConfig(kl_threshold=0.1)).before_update(rollout_kl=0.05).events


def test_nan_guard_restores_after_patience_consecutive_bad_steps():
    guards = Guards(GuardsConfig(nan_skip_and_restore=True, nan_patience=2))
    assert not guards.after_update(0.5, losses_finite=False).restore_checkpoint
    assert not guards.after_update(0.5, losses_finite=True).restore_checkpoint  # streak reset
    assert not guards.after_update(0.5, losses_finite=False).restore_checkpoint
    fired = guards.after_update(0.5, losses_finite=False)
    assert fired.restore_checkpoint and fired.events[0][0] == "guard/nan"


def test_reward_collapse_halves_lr_and_rolls_back_once_armed():
    guards = Guards(GuardsConfig(reward_collapse_fraction=0.5, reward_ema_steps=3))
    # EMA with alpha = 2 / (3 + 1) = 0.5 over scores 0.8, 0.8, 0.8 -> 0.8; armed after 3 steps.
    for _ in range(3):
        assert not guards.after_update(0.8, losses_finite=True).halve_lr
    assert guards.state.score_ema == 0.8
    assert not guards.after_update(0.5, losses_finite=True).halve_lr  # 0.5 >= 0.5 * 0.8: no collapse
    ema = guards.state.score_ema  # 0.5 * 0.8 + 0.5 * 0.5 = 0.65
    assert abs(ema - 0.65) < 1e-12
    v = guards.after_update(0.3, losses_finite=True)  # 0.3 < 0.5 * 0.65 = 0.325
    assert v.halve_lr and v.restore_checkpoint
    assert v.events == [("guard/reward_collapse", {"score": 0.3, "ema": 0.65, "fraction": 0.5})]
    assert guards.state.score_ema == 0.65  # a collapsed step does not drag the baseline down


def test_guard_state_round_trips():
    guards = Guards(GuardsConfig(reward_collapse_fraction=0.5))
    guards.after_update(0.7, losses_finite=False)
    # the first finite score starts the EMA; one non-finite step starts the streak (nan_skip_and_restore is on)
    assert guards.state_dict() == {"score_ema": 0.7, "steps_seen": 1, "nan_streak": 1}
    other = Guards(GuardsConfig(reward_collapse_fraction=0.5))
    other.load_state_dict(guards.state_dict())
    assert other.state == guards.state
