"""The one owner of layout arithmetic, torch-free (a test imports it with torch blocked).

- `parallel.py`: `ParallelLayout` (tp / pp / dp / cp / ep / etp / vpp and uneven end stages): the
  degrees' checks, the layers of every pipeline stage and model chunk (`stage_layers`), and
  Megatron-Core's rank map ("tp-cp-ep-dp-pp", experts etp-ep-edp) as `RankCoords`;
- `model.py`: `ModelShape` and `check_model`, what a model allows of a layout (heads, widths,
  latent rows over tp, layers over stages, experts over ep; heads over rollout.tp), and what megarl's
  trainer refuses;
- `rollout.py`: rollout groups (`check_rollout`, `rollout_blocks`, `assign_rollout`,
  `separate_assignment` for separate placement) and the HybridFlow transition bound;
- `sync_cost.py`: what a delta weight sync puts on the wire (the encoding choice and its share of a
  full sync).

`megarl.distributed.parallel.ParallelDims` (process groups), config validation, the planner (`megarl.capacity`),
the model builder, the HybridEngine and the rollout builder all read it.
"""
from megarl.layout.model import ModelShape, check_model, check_rollout_heads, check_training, padded_vocab, refuse_moe_tensor_parallel
from megarl.layout.parallel import ParallelLayout, RankCoords, check_degrees, stage_layers
from megarl.layout.rollout import (RolloutAssignment, RolloutLayout, assign_rollout, check_rollout, hybridflow_bytes_per_rank,
                                   rollout_blocks, separate_assignment)

__all__ = ["ModelShape", "check_model", "check_rollout_heads", "check_training", "padded_vocab", "refuse_moe_tensor_parallel", "ParallelLayout", "RankCoords", "check_degrees",
           "stage_layers", "RolloutAssignment", "RolloutLayout", "assign_rollout", "check_rollout", "hybridflow_bytes_per_rank",
           "rollout_blocks", "separate_assignment"]
