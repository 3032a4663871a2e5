"""Device and collective backend: CUDA + NCCL when a GPU is present, else CPU + gloo.

On CPU the Megatron-Core compatibility layer (`cpu_compat`) is applied before any Megatron object
is built. Everything else in megarl asks this module which device to allocate on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
import logging
import re
import warnings

import torch

from megarl.platform import cpu_compat
from megarl.platform.cpu_compat import define_te_general_gemm


@dataclass(frozen=True)
class Platform:
    device: torch.device
    backend: str  # torch.distributed backend: "nccl" or "gloo"

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"


_PLATFORM: Platform | None = None


def init_platform(force_cpu: bool | None = None) -> Platform:
    """Choose the device once per process. MEGARL_FORCE_CPU=1 selects CPU even when a GPU exists."""
    global _PLATFORM
    if _PLATFORM is not None:
        return _PLATFORM
    if force_cpu is None:
        force_cpu = os.environ.get("MEGARL_FORCE_CPU", "0") == "1"
    if torch.cuda.is_available() and not force_cpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        # Megatron's MoE router calls `te_general_gemm` whenever the name exists and only imports it
        # with Transformer-Engine: without TE every MoE forward raised NameError on GPU as well.
        define_te_general_gemm()
        _PLATFORM = Platform(torch.device("cuda", local_rank), "nccl")
    else:
        cpu_compat.apply()
        _PLATFORM = Platform(torch.device("cpu"), "gloo")
    return _PLATFORM


def current_platform() -> Platform:
    if _PLATFORM is None:
        return init_platform()
    return _PLATFORM


# Messages every CPU run prints, none of which a user can act on: the optional GPU packages are
# absent by design, and the rest are deprecations inside torch / Megatron-Core.
KNOWN_NOISE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"full scope is deprecated",
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    r"When using async grad allreduce it is recommended",
    r"tp_group is None, using default tp group",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    # Megatron-Core 0.19 (absl is optional; MIMO is a model megarl does not use).
    r"absl\.logging is not installed",
    r"MimoModelConfig is experimental",
)
# The same through `logging` (logger name: message pattern). Megatron-Core 0.19 logs the first three;
# the last is torch on a CUDA build without a GPU (the Python 3.12 environment).
KNOWN_LOG_NOISE = {
    "megatron.core.models.gpt.gpt_model": r"GPTModel IS DEPRECATED",
    "megatron.core.distributed.distributed_data_parallel": r"DistributedDataParallel: full_param_layout not provided",
    "megatron.core.dist_checkpointing.strategies.torch": r"MCore's async save is deprecated",
    "torch.utils.cpp_extension": r"No CUDA runtime is found",
}


class _DropMatching:
    """A `logging` filter that drops records whose message matches one pattern."""

    def __init__(self, pattern: str):
        self.pattern = re.compile(pattern)

    def filter(self, record) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_known_warnings() -> None:
    """Hide the warnings in KNOWN_NOISE and KNOWN_LOG_NOISE (entry points call this; libraries never do)."""
    for pattern in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    for name, pattern in KNOWN_LOG_NOISE.items():
        # A logger's own filters see every record created on it (Megatron logs on its module's logger).
        logging.getLogger(name).addFilter(_DropMatching(pattern))
