"""The environment a policy acts in over several turns, and how a config names one.

    class Calculator(megarl.agents.Environment):
        def reset(self, row):            # the prompt's dataset row; text appended after the prompt, or None
            self.answer = row["ground_truth"]
        def step(self, turn):            # turn.text, turn.token_ids: the policy's last turn
            ...
            return observation, reward, done   # observation: text of the environment's turn, or None

    rollout.multi_turn.environment: "my_package.envs:Calculator"   # found on PYTHONPATH

One instance per sample (the class is called with no arguments). `megarl.rollout.multi_turn`
runs the episodes; this module imports neither torch nor the trainer.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Turn:
    """The policy's last turn: its tokens as sampled (the stop token included when it stopped on
    one) and their text (the final stop token dropped, every other token decoded as is)."""

    text: str
    token_ids: tuple[int, ...]
    index: int = 0  # 0 for the policy's first turn
    finish_reason: str = "stop"  # "length": the turn was cut at max_tokens_per_turn


class Environment:
    """Subclass and implement `step` (and `reset` when an episode needs the prompt's row)."""

    def reset(self, row: dict[str, Any]) -> str | None:
        """Start an episode for this prompt row (prompt, ground_truth, data_source and the row's
        other columns); the returned text is appended after the prompt, before the policy's first
        turn (not trained on), or None."""
        return None

    def step(self, turn: Turn) -> tuple[str | None, float, bool]:
        """React to the policy's turn: (observation text appended as the environment's turn, or
        None; reward added to the sample's score; done: the episode ends)."""
        raise NotImplementedError(f"{type(self).__name__}.step(turn) -> (observation, reward, done)")


class EnvironmentSpecError(ValueError):
    """rollout.multi_turn.environment does not name an Environment class; one line naming the fix."""


def load_environment_class(spec: str) -> type[Environment]:
    """`"module:Class"` -> the class (module imported from PYTHONPATH); a subclass of Environment,
    or any class with `reset` and `step`."""
    key = "rollout.multi_turn.environment"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentSpecError(f"{key}={spec!r}: expected 'module:Class' (e.g. 'my_envs.calculator:Calculator')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvironmentSpecError(f"{key}={spec!r}: cannot import {module_name!r} ({e}); put its directory on PYTHONPATH") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise EnvironmentSpecError(f"{key}={spec!r}: module {module_name!r} has no class {attr!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvironmentSpecError(f"{key}={spec!r}: {attr} lacks {', '.join(missing)}; subclass megarl.agents.Environment")
    return cls
