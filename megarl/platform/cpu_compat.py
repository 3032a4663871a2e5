"""Megatron-Core on CPU with gloo: the ten seams of Megatron-Core that assume CUDA (or Transformer-Engine).

Applied only when no GPU is present (see `megarl.platform.init_platform`); on GPU nothing here
runs. Each seam is one function below, named after what it covers, so a test can check it on its
own and a newer Megatron-Core release can be audited seam by seam; `SEAMS` says which minor lines
each one is applied to. The layer is pinned to the Megatron-Core range it was audited against
(`mcore_version`): anything else is refused with a clear message, because a silently missed seam
shows up much later as a wrong gradient or a hang.

It is long because the seams are audited together against one Megatron-Core release: one file,
one function per seam, is what a reviewer walks when a new release lands.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from megarl.platform.mcore_version import (
    NEWEST_SUPPORTED,
    OLDEST_SUPPORTED,
    UnsupportedMegatronVersion,
    check_megatron_version,
    installed_version,
    minor_line,
)

_APPLIED = False


# --- seam 1 + 2: CUDA device placement -----------------------------------------------------------


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Megatron passes torch.cuda.current_device() (an int) as a device in many places.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device=` arguments that name CUDA into the CPU device (seam 2).

    Megatron allocates with literal device='cuda' in the optimizer, grad scaler, clip_grads, the
    pipeline schedules and tensor_parallel/data.py. A function mode catches all of them without
    patching each call site. It also drops `pin_memory=True`: a host-to-device staging buffer has no
    meaning without a device, and the CPU build refuses it (Megatron's `get_pos_emb_on_this_cp_rank`
    pins its two-element index, which YaRN's rope calls when it is built at cp > 1).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        elif func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_CUDA_TO_CPU_MODE: CudaToCpuMode | None = None


def patch_current_device() -> None:
    """Seam 1: `torch.cuda.current_device()` is used as an allocation device -> the CPU device."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # `Tensor.cuda()` becomes identity: tensors already live where compute happens.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]


def enter_cuda_to_cpu_mode() -> None:
    """Seam 2: literal device='cuda' allocations -> CPU, for the rest of the process."""
    global _CUDA_TO_CPU_MODE
    if _CUDA_TO_CPU_MODE is None:
        _CUDA_TO_CPU_MODE = CudaToCpuMode()
        _CUDA_TO_CPU_MODE.__enter__()
        torch.autograd._engine_run_backward = _engine_run_backward_in_mode


_ORIGINAL_ENGINE_RUN_BACKWARD = torch.autograd.graph._engine_run_backward
_PAUSED = False  # inside device_rewrite_paused(): torch calls run without the mode
_BACKWARD_PAUSED = False  # inside backward_without_device_rewrite(): backward passes run without it


def _engine_run_backward_in_mode(*args, **kwargs):
    # A mode is switched off while it handles a call, and `Tensor.backward`, `torch.autograd.backward`
    # (Megatron's schedules) and `torch.autograd.grad` are calls it handles: the whole backward pass
    # (Python autograd Functions, activation recompute, DDP grad hooks) would run without it and hit
    # device='cuda'. All three reach the engine through this function, so switch the mode back on here
    # (unless the caller paused it: device_rewrite_paused).
    mode = _CUDA_TO_CPU_MODE
    if mode is None or _PAUSED or _BACKWARD_PAUSED or mode in torch.overrides._get_current_function_mode_stack():
        return _ORIGINAL_ENGINE_RUN_BACKWARD(*args, **kwargs)
    with mode:
        return _ORIGINAL_ENGINE_RUN_BACKWARD(*args, **kwargs)


@contextlib.contextmanager
def device_rewrite_paused(enabled: bool = True):
    """Run a block without seam 2's mode: for code known not to name CUDA (a dense model's forward and
    backward, transformers' generate).

    A function mode routes every torch call through Python: about 2.5 us per call on CPU, ~25,000
    calls per demo train step (9% of it), and all of HF generation. Megatron's literal device='cuda'
    allocations are in the optimizer, grad scaler, clip_grads and the schedules' setup, not in a
    dense model's layers (they allocate on `torch.cuda.current_device()`, seam 1, and `.cuda()` is
    the identity). A no-op on GPU, where the mode is never entered, or when `enabled` is false.
    """
    global _PAUSED
    mode = _CUDA_TO_CPU_MODE
    if not enabled or mode is None or _PAUSED:
        yield
        return
    stack = torch.overrides._get_current_function_mode_stack()
    on_top = bool(stack) and stack[-1] is mode
    _PAUSED = True
    try:
        if on_top:
            with torch.overrides._pop_mode_temporarily():
                yield
        else:  # already switched off here (inside the mode's own handling of a call)
            yield
    finally:
        _PAUSED = False


@contextlib.contextmanager
def backward_without_device_rewrite(enabled: bool = True):
    """Backward passes started inside the block (by Megatron's schedule, which itself stays under the
    mode) run without it: for a dense model, whose backward (Megatron's autograd Functions, the
    gradient-buffer accumulation) names no CUDA device. See device_rewrite_paused."""
    global _BACKWARD_PAUSED
    if not enabled or _BACKWARD_PAUSED:
        yield
        return
    _BACKWARD_PAUSED = True
    try:
        yield
    finally:
        _BACKWARD_PAUSED = False


# --- seam 3: the RNG tracker -----------------------------------------------------------------------


class CpuRNGStatesTracker:
    """Megatron's named RNG states (model-parallel, expert-parallel, data-parallel) on the CPU generator.

    Same interface as `tensor_parallel.random.CudaRNGStatesTracker`: `add(name, seed)` creates a
    state, `fork(name)` runs a block under it and keeps its advanced state for next time.
    """

    def __init__(self, *args, **kwargs):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_cpu_rng_tracker() -> None:
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # model_parallel_cuda_manual_seed calls torch.cuda.manual_seed (a no-op without CUDA) and
    # rebuilds the tracker only when asked to; keep it ours when it does.
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    # Activation recompute (tensor_parallel.CheckpointFunction) saves "the CUDA RNG state" before the
    # forward and restores it for the recomputation; torch.cuda.get_rng_state fails without CUDA.
    # On CPU that generator is the CPU one (the tracker above forks it too).
    mcore_random._get_cuda_rng_state = _get_cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state


def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False) -> None:
    torch.set_rng_state(new_state)


# --- seam 4: streams and events ----------------------------------------------------------------------


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_NULL_STREAM = _NullStream()


def install_null_streams() -> None:
    """Seam 4: CUDA streams/events -> no-op stand-ins (the MoE dispatcher creates a stream at init)."""
    torch.cuda.Stream = _NullStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _NullEvent  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: _NULL_STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _NULL_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[assignment]


# --- seam 5: te_general_gemm -------------------------------------------------------------------------


def define_te_general_gemm() -> None:
    """Seam 5: moe_utils refers to te_general_gemm, undefined without Transformer-Engine."""
    from megatron.core.transformer.moe import moe_utils  # deferred: megatron (seconds to import) loads only when this runs

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# --- seam 6: gradient clipping -----------------------------------------------------------------------


def clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of `clip_grads.clip_grad_by_total_norm_fp32` (which asserts torch.cuda.FloatTensor).

    Same rule: scale every gradient by max_norm / (total_norm + 1e-6) when that is below one.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.detach().mul_(clip_coeff)


def install_cpu_grad_clip() -> None:
    from megatron.core.optimizer import clip_grads  # deferred: megatron (seconds to import) loads only when this runs
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.optimizer import optimizer as mcore_optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu
    # optimizer.py imported the name directly; replace it there too.
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu


# --- seam 7: MoE token dispatcher ---------------------------------------------------------------------

CPU_MOE_TOKEN_DISPATCHER = "allgather"


def cpu_moe_token_dispatcher(requested: str) -> str:
    """Seam 7: gloo rejects the alltoall dispatcher's split sizes; the allgather dispatcher works."""
    return CPU_MOE_TOKEN_DISPATCHER if requested == "alltoall" else requested


# --- seam 8: finalize_model_grads --------------------------------------------------------------------


def require_finalize_model_grads(config) -> None:
    """Seam 8: without `finalize_model_grads_func` on the config, DP gradients are never reduced."""
    if getattr(config, "finalize_model_grads_func", None) is None:
        # deferred: megatron (seconds to import) loads only when this runs
        from megatron.core.distributed import finalize_model_grads

        config.finalize_model_grads_func = finalize_model_grads


# --- seam 10: multi-latent attention without Transformer-Engine --------------------------------------


def mla_without_transformer_engine() -> None:
    """Seam 10: 0.16's multi_latent_attention sets HAVE_TE = True whenever Megatron's TE extension
    module imports, which it does without TE (its classes are then MagicMock stand-ins), and
    `isinstance(linear_proj, TELinear)` raises TypeError when the MLA layer is built. Tell it the
    truth. Applied where the MLA layer spec is built (`megarl.models.builder.layer_spec`), on
    every platform without TE (a GPU image without TE hits it too); a no-op where the module
    already knows (0.19 imports HAVE_TE from the extension)."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.extensions import transformer_engine as te_extension
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.HAVE_TE and not getattr(te_extension, "HAVE_TE", True):
        multi_latent_attention.HAVE_TE = False


# --- seam 9: tensor type names in the optimizers -----------------------------------------------------

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}
_ORIGINAL_TENSOR_TYPE = torch.Tensor.type


def _tensor_type_with_cuda_names(self, *args, **kwargs):
    # Only the no-argument query form is changed: the optimizers compare it with CUDA type names.
    # `t.type(dtype)` conversions are untouched. Meta tensors stand for device tensors in the dry run
    # (megarl.platform.fake_world).
    if not args and not kwargs and self.device.type in ("cpu", "meta") and self.dtype in _CUDA_TYPE_NAMES:
        return _CUDA_TYPE_NAMES[self.dtype]
    return _ORIGINAL_TENSOR_TYPE(self, *args, **kwargs)


def answer_cuda_type_names() -> None:
    """Seam 9: the (distributed) optimizer checks param.type() against 'torch.cuda.FloatTensor' etc."""
    torch.Tensor.type = _tensor_type_with_cuda_names  # type: ignore[assignment]


@dataclass(frozen=True)
class Seam:
    """One process-wide seam and the Megatron-Core minor lines that need it (inclusive)."""

    install: Callable[[], None]
    first: tuple[int, int] = OLDEST_SUPPORTED
    last: tuple[int, int] = NEWEST_SUPPORTED
    why_not_later: str = ""  # for a seam retired before NEWEST_SUPPORTED: what the later release fixed

    def needed_by(self, version: str) -> bool:
        return self.first <= minor_line(version) <= self.last


SEAMS = (
    Seam(patch_current_device),
    Seam(enter_cuda_to_cpu_mode),
    Seam(install_cpu_rng_tracker),
    Seam(install_null_streams),
    Seam(define_te_general_gemm, last=(0, 16),
         why_not_later="since 0.17 moe_utils sets te_general_gemm = None itself when Transformer-Engine is absent"),
    Seam(install_cpu_grad_clip),
    # seam 7 (token dispatcher) and seam 8 (finalize_model_grads) are applied where the
    # TransformerConfig is built: megarl.models.builder calls cpu_moe_token_dispatcher and
    # require_finalize_model_grads; seam 10 (MLA without TE) where the layer spec is built. Both are needed by every supported release (0.19 still
    # defaults finalize_model_grads_func to None, and gloo still rejects the alltoall splits).
    Seam(answer_cuda_type_names),
)


def seams_for(version: str) -> list[Seam]:
    """The process-wide seams a Megatron-Core release needs (`version` must be in the supported range)."""
    return [seam for seam in SEAMS if seam.needed_by(version)]


def apply() -> None:
    """Apply the process-wide seams the installed release needs, once. Only call this when no GPU is used."""
    global _APPLIED
    if _APPLIED:
        return
    version = check_megatron_version(installed_version())
    for seam in seams_for(version):
        seam.install()
    _APPLIED = True


def is_applied() -> bool:
    return _APPLIED


__all__ = ["apply", "is_applied", "seams_for", "check_megatron_version", "UnsupportedMegatronVersion"]
