"""Process groups over the layout (issue 40's floor plan): `parallel.py` (`ParallelDims`: a
`megarl.layout.ParallelLayout` plus Megatron's process groups), `placement.py` (rollout.placement and
the world split). Kept apart from the torch-free `megarl.layout`: both import torch.distributed."""
