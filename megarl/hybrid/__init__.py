"""3D-HybridEngine: reshard the actor from the training layout into a colocated rollout engine."""
from megarl.hybrid.dispatch import DispatchGroups, consecutive_rollout_group, generate_for_training
from megarl.hybrid.engine import HybridEngine, SyncStats
from megarl.hybrid.layout import RolloutLayout, TrainLayout  # megarl.layout.ParallelLayout
from megarl.hybrid.verify import SYNC_CHECKS, WeightSyncMismatch, check_sync, compare_logprobs

__all__ = ["DispatchGroups", "HybridEngine", "consecutive_rollout_group", "RolloutLayout", "SyncStats", "TrainLayout", "WeightSyncMismatch",
           "SYNC_CHECKS", "check_sync", "compare_logprobs", "generate_for_training"]
