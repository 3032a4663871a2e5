"""The regression gate's verdict on paired samples: per phase, the candidate's median wall time over the
base's, with a bootstrap interval over the rounds (pure Python; hand-made samples test it).

Round i ran the base and the candidate one right after the other, so the pair (base[i], candidate[i]) saw the
same moment of the machine's load. The bootstrap therefore resamples rounds, pairs kept together: a load
swing that hits both sides of a round moves both medians alike. A noisy machine spreads the resampled
ratios, so the interval widens and the phase passes ("noise widens the interval instead of raising a false
alarm"); a phase is a regression only when its ratio is above 1 + tolerance AND the interval's lower end is
above 1 (the slowdown is larger than what the rounds' spread can explain). That is the approach of asv
`continuous` and pytest-benchmark `--benchmark-compare`: base and candidate measured in one session,
interleaved, compared with a statistical test.

The gate alternates which side runs first in a round, so each side runs twice in a row across every round
boundary: the side that runs first in a round ran just before (its caches warm), the second ran after the
other side's whole step. A phase that touches much memory shows it: the weight sync took about 3 ms first
and 9 ms second on the 2-core machine, so each round paired a warm sample with a cold one, each side's
samples were two clusters, and their medians (and a 25% injected slowdown) drowned in which cluster the
median fell. Given `base_first` (per round, whether the base ran first), each side is compared at the same
position: the candidate's samples when it ran first against the base's when it ran first, likewise second,
and the two ratios combined by their geometric mean (a side's reported median is the geometric mean of its
two position medians); the bootstrap resamples rounds within each order. Without a position effect this
reads what the plain ratio of medians reads.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

DEFAULT_TOLERANCE = 0.10   # a slowdown smaller than this is not called a regression, however certain
DEFAULT_CONFIDENCE = 0.95
DEFAULT_MIN_SECONDS = 5e-4  # a phase whose base median is shorter is reported, not gated (timer noise)
RESAMPLES = 2000


def ratio_of_medians(base: list[float], candidate: list[float]) -> float:
    return statistics.median(candidate) / statistics.median(base)


def _by_position(samples: list[float], first: list[bool]) -> tuple[list[float], list[float]]:
    """(the samples of the rounds a side ran first, those it ran second)."""
    return [x for x, f in zip(samples, first) if f], [x for x, f in zip(samples, first) if not f]


def _both_orders(base_first: list[bool] | None) -> bool:
    return base_first is not None and any(base_first) and not all(base_first)


def matched_medians(base: list[float], candidate: list[float], base_first: list[bool] | None = None) -> tuple[float, float]:
    """(base, candidate) medians; with both orders in base_first, each the geometric mean of its medians
    at the two positions (first, second in a round), so that their ratio compares like with like."""
    if not _both_orders(base_first):
        return statistics.median(base), statistics.median(candidate)
    candidate_first = [not f for f in base_first]
    b1, b2 = _by_position(base, base_first)
    c1, c2 = _by_position(candidate, candidate_first)
    return (math.sqrt(statistics.median(b1) * statistics.median(b2)),
            math.sqrt(statistics.median(c1) * statistics.median(c2)))


def paired_bootstrap_interval(base: list[float], candidate: list[float], confidence: float = DEFAULT_CONFIDENCE,
                              resamples: int = RESAMPLES, seed: int = 0,
                              base_first: list[bool] | None = None) -> tuple[float, float]:
    """Percentile interval of the ratio of (matched_medians) medians, resampling rounds (pairs kept
    together; within each order when base_first has both), seeded."""
    if len(base) != len(candidate) or not base:
        raise ValueError(f"paired samples need the same, non-zero number of rounds (base {len(base)}, candidate {len(candidate)})")
    if base_first is not None and len(base_first) != len(base):
        raise ValueError(f"base_first needs one entry per round ({len(base_first)} for {len(base)} rounds)")
    rng, n = random.Random(seed), len(base)
    orders = ([[i for i in range(n) if base_first[i]], [i for i in range(n) if not base_first[i]]]
              if _both_orders(base_first) else [list(range(n))])
    ratios = []
    for _ in range(resamples):
        rounds = [rng.choice(order) for order in orders for _ in order]
        b, c = matched_medians([base[i] for i in rounds], [candidate[i] for i in rounds],
                               [base_first[i] for i in rounds] if base_first is not None else None)
        ratios.append(c / b)
    ratios.sort()
    tail = (1.0 - confidence) / 2
    return ratios[int(tail * (resamples - 1))], ratios[int(round((1.0 - tail) * (resamples - 1)))]


@dataclass(frozen=True)
class PhaseVerdict:
    phase: str
    base_median_s: float
    candidate_median_s: float
    ratio: float               # candidate median / base median (wall time)
    interval: tuple[float, float]
    gated: bool                # base median >= min_seconds
    regressed: bool
    inconclusive: bool         # passed, but the interval reaches above 1 + tolerance: too noisy to rule one out
    base_cpu_median_s: float | None = None       # diagnostic only
    candidate_cpu_median_s: float | None = None  # diagnostic only

    def line(self) -> str:
        """One row of the report."""
        verdict = ("REGRESSION" if self.regressed else "inconclusive" if self.inconclusive
                   else "ok" if self.gated else "not gated")
        lo, hi = self.interval
        cpu = ""
        if self.base_cpu_median_s is not None and self.candidate_cpu_median_s is not None:
            cpu = f"  cpu {self.candidate_cpu_median_s:.4f} s vs {self.base_cpu_median_s:.4f} s"
        return (f"{verdict:>12}  {self.phase:<14} wall {self.candidate_median_s:.4f} s vs {self.base_median_s:.4f} s  "
                f"{self.ratio:5.2f}x [{lo:.2f}, {hi:.2f}]{cpu}")

    def failure(self, rounds: int, commits: str, confidence: float) -> str:
        """The line a failing gate prints for this phase: the phase, the slowdown, the interval, the commits."""
        lo, hi = self.interval
        return (f"phase '{self.phase}' takes {self.ratio:.2f}x its base wall time (+{self.ratio - 1:.0%}; "
                f"{confidence:.0%} interval {lo:.2f}x-{hi:.2f}x; median {self.candidate_median_s:.4f} s vs "
                f"{self.base_median_s:.4f} s over {rounds} paired rounds) in {commits}")


def judge(phase: str, base: list[float], candidate: list[float], tolerance: float = DEFAULT_TOLERANCE,
          confidence: float = DEFAULT_CONFIDENCE, min_seconds: float = DEFAULT_MIN_SECONDS,
          base_cpu: list[float] | None = None, candidate_cpu: list[float] | None = None,
          base_first: list[bool] | None = None) -> PhaseVerdict:
    """The verdict on one phase's paired wall times (seconds, one per round and side); base_first: per
    round, whether the base ran first (each side is then compared at the same position)."""
    base_median, candidate_median = matched_medians(base, candidate, base_first)
    ratio = candidate_median / base_median
    interval = paired_bootstrap_interval(base, candidate, confidence, base_first=base_first)
    gated = base_median >= min_seconds
    regressed = gated and ratio > 1 + tolerance and interval[0] > 1.0
    return PhaseVerdict(phase, base_median, candidate_median, ratio, interval, gated, regressed,
                        inconclusive=gated and not regressed and interval[1] > 1 + tolerance,
                        base_cpu_median_s=statistics.median(base_cpu) if base_cpu else None,
                        candidate_cpu_median_s=statistics.median(candidate_cpu) if candidate_cpu else None)
