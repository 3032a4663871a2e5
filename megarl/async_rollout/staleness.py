"""Policy versions and bounded staleness, pure Python.

Version v = the actor weights after v trainer steps (v = 0: the initial weights). The trainer at
step s trains the weights of version s - 1, so a sample whose oldest token was sampled under
version v has staleness (s - 1) - v. With async.max_staleness K a sample with staleness > K is
never trained on: it is dropped and its prompt generated again under the newest weights
(counted in `async/dropped_stale`). A sample continued across a weight update (partial rollout)
counts from its oldest token, as AReaL and verl count a trajectory spanning versions.
"""
from __future__ import annotations

from dataclasses import dataclass


def trained_version(step: int) -> int:
    """The policy version the trainer updates at `step` (steps counted from 1)."""
    return step - 1


def staleness(step: int, oldest_version: int) -> int:
    """How many updates the policy that sampled a token is behind the one trained at `step`."""
    return trained_version(step) - oldest_version


def is_fresh(step: int, oldest_version: int, max_staleness: int) -> bool:
    return staleness(step, oldest_version) <= max_staleness


@dataclass
class StalenessStats:
    """The `async/` metrics of one step, over the samples trained (this rank's; merged over ranks
    by the caller). Versions: each trained sample's oldest version; dropped: samples refused."""

    staleness_sum: float = 0.0
    staleness_max: int = 0
    samples: int = 0
    dropped: int = 0
    spanning: int = 0  # samples whose tokens carry more than one version (partial rollout)

    def add(self, step: int, versions) -> None:
        age = staleness(step, min(versions))
        self.staleness_sum += age
        self.staleness_max = max(self.staleness_max, age)
        self.samples += 1
        self.spanning += int(len(set(versions)) > 1)

    def metrics(self) -> dict[str, float]:
        return {"async/staleness_mean": self.staleness_sum / max(self.samples, 1),
                "async/staleness_max": float(self.staleness_max),
                "async/dropped_stale": float(self.dropped),
                "async/partial_fraction": self.spanning / max(self.samples, 1)}


def split_fresh(samples, step: int, max_staleness: int):
    """(kept, dropped): samples within max_staleness of the policy trained at `step`, and the rest.
    A sample without versions (an engine that does not track them) counts as fresh."""
    kept, dropped = [], []
    for s in samples:
        oldest = s.oldest_version
        (kept if oldest is None or is_fresh(step, oldest, max_staleness) else dropped).append(s)
    return kept, dropped
