"""Training and rollout layouts for the HybridEngine: names kept for existing imports; the
arithmetic lives in `megarl.layout` (the one owner). `TrainLayout` is `ParallelLayout`
(positional tp, pp, dp, ep; cp and the rest by keyword)."""
from megarl.layout import (ParallelLayout, RankCoords, RolloutAssignment, RolloutLayout, assign_rollout,
                           hybridflow_bytes_per_rank)

TrainLayout = ParallelLayout

__all__ = ["RankCoords", "RolloutAssignment", "RolloutLayout", "TrainLayout", "assign_rollout", "hybridflow_bytes_per_rank"]
