"""Guards: automatic reactions to unhealthy PPO steps (the risk table verl/OpenRLHF users expect).

Each guard is off unless configured, and every firing is returned as an event for the tracker.
The trainer applies the actions; this module only decides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarl.config import GuardsConfig


@dataclass
class GuardState:
    score_ema: float | None = None
    steps_seen: int = 0
    nan_streak: int = 0

    def state_dict(self) -> dict:
        return {"score_ema": self.score_ema, "steps_seen": self.steps_seen, "nan_streak": self.nan_streak}

    def load_state_dict(self, state: dict) -> None:
        self.score_ema, self.steps_seen, self.nan_streak = state["score_ema"], state["steps_seen"], state["nan_streak"]


@dataclass
class Verdict:
    skip_actor_update: bool = False
    raise_kl_coef: bool = False
    restore_checkpoint: bool = False
    halve_lr: bool = False
    events: list[tuple[str, dict]] = field(default_factory=list)


class Guards:
    def __init__(self, cfg: GuardsConfig):
        self.cfg = cfg
        self.state = GuardState()

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the score EMA, the steps it has seen, the non-finite streak."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)

    def before_update(self, rollout_kl: float) -> Verdict:
        """After scoring, before the updates: KL of the rollout against the reference."""
        v = Verdict()
        if self.cfg.kl_threshold > 0 and rollout_kl > self.cfg.kl_threshold:
            if self.cfg.kl_action == "skip_update":
                v.skip_actor_update = True
            else:
                v.raise_kl_coef = True
            v.events.append(("guard/kl", {"kl": rollout_kl, "threshold": self.cfg.kl_threshold, "action": self.cfg.kl_action}))
        return v

    def after_update(self, score_mean: float, losses_finite: bool) -> Verdict:
        """After the updates: non-finite losses and reward collapse."""
        v = Verdict()
        if self.cfg.nan_skip_and_restore:
            self.state.nan_streak = 0 if losses_finite else self.state.nan_streak + 1
            if self.state.nan_streak >= self.cfg.nan_patience:
                v.restore_checkpoint = True
                v.events.append(("guard/nan", {"streak": self.state.nan_streak}))
                self.state.nan_streak = 0
        frac = self.cfg.reward_collapse_fraction
        ema = self.state.score_ema
        armed = self.state.steps_seen >= self.cfg.reward_ema_steps
        if frac > 0 and armed and ema is not None and ema > 0 and score_mean < frac * ema:
            v.halve_lr = v.restore_checkpoint = True
            v.events.append(("guard/reward_collapse", {"score": score_mean, "ema": ema, "fraction": frac}))
        elif math.isfinite(score_mean):
            alpha = 2.0 / (self.cfg.reward_ema_steps + 1)
            self.state.score_ema = score_mean if ema is None else (1 - alpha) * ema + alpha * score_mean
            self.state.steps_seen += 1
        return v
