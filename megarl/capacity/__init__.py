"""Capacity planning on paper: will a layout fit, what does a weight sync cost, where does the
step time go. Pure arithmetic from a HF config.json (no torch model is built), documented so
that the engine's own numbers can be checked against it (tests/capacity):

- `arch`: the model's tensors as Megatron holds them, parameter counts, FLOPs per token;
- `hardware`: the GPU table (memory, bf16 peak, NVLink/IB bandwidth), user-extendable;
- `estimate`: per-GPU memory by phase, weight-sync bytes, step time by phase, layout search.
- `memory_check`: the start-up memory check of a colocated vLLM/SGLang engine (megarl.run; it
  decides the offloads left null); it imports torch lazily and is not imported here.

CLI: `python -m megarl.tools.plan` (megarl/tools/plan.py).
"""
from megarl.capacity.arch import Arch, arch_from_config, load_config, params_total, train_flops_per_token
from megarl.capacity.estimate import Cluster, Layout, RunShape, plan, search, sync_bytes
from megarl.capacity.hardware import GPUS, gpu_table

__all__ = ["Arch", "arch_from_config", "load_config", "params_total", "train_flops_per_token", "Cluster", "Layout",
           "RunShape", "plan", "search", "sync_bytes", "GPUS", "gpu_table"]
