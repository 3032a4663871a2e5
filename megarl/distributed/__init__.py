"""Process groups over the layout (issue 40's floor plan): `parallel.py` (`ParallelDims`: a
`megarl.layout.ParallelLayout` plus Megatron's process groups, host-side collectives). Kept apart
from the torch-free `megarl.layout`: it imports torch.distributed and Megatron's parallel state.
Separate placement's world split is megarl.async_rollout.placement, its config rules
megarl.config.placement_rules, so this package imports nothing above the layout and the platform."""
