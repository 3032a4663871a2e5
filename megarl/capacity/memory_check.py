"""The start-up memory check of a colocated rollout engine (`rollout.memory_check`; docs/operations.md).

vLLM and SGLang share each GPU with the training engines (actor, critic, reference) and take
`rollout.gpu_memory_utilization` of its memory for their weights and KV cache. The KV pool is sized
when the engine is built, before Adam's moments exist (Megatron creates them at the first optimizer
step), and is mapped again at every wake-up: from step 2 on, the training state left on the GPU
while the engine generates includes the moments, and a budget that fit at start-up runs out of
memory there. So at start-up, on CUDA with engine vllm or sglang, the planner's arithmetic
(`megarl.capacity.estimate.engine_state`: Megatron's DDP parameter and fp32 gradient buffers, Adam's
two fp32 moments and the fp32 main parameters of bf16 weights sharded over data parallelism, per
role) estimates

    training state on the GPU while the engine generates (step 2 on, with the optimizer state)
    + rollout.gpu_memory_utilization x device memory + 4 GiB (CUDA context, NCCL, fragmentation)
    + under rollout.weight_sync.mode=delta, the copy of what was last synced (about twice the bytes
      a full sync brings the GPU; megarl.capacity.estimate.weight_sync_delta)

against the device's memory. When that does not fit, offloads left null are turned on, cheapest
first as verl's colocated recipes do (gradients and optimizer state of actor and critic, then the
parameters of every role), until it fits; an offload the user set (true or false) is never changed.
When it still does not fit, the run stops (exit 2) with one line naming the knobs. Every offload
still null afterwards is off. The reward model (reward.kind=model) and activations are not
counted: the engine's budget is what competes with the training state during generation.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from megarl.capacity.arch import arch_from_config, load_config
from megarl.capacity.estimate import Cluster, RunShape, check, engine_state, offloaded_bytes, sync_bytes, weight_sync_delta
from megarl.capacity.from_config import planner_inputs
from megarl.capacity.hardware import GPU
from megarl.config.schema import Config, ConfigError

GIB = 2**30
OVERHEAD_BYTES = 4 * GIB  # megarl.capacity.estimate.RunShape.overhead_gib
# In the order they are turned on: what the engine never needs during generation and costs one
# host round trip per step first (gradients, optimizer state), then the parameters, which the weight
# sync also reads back.
OFFLOAD_ORDER = (("actor", "grad_offload"), ("actor", "optimizer_offload"), ("critic", "grad_offload"),
                 ("critic", "optimizer_offload"), ("actor", "param_offload"), ("critic", "param_offload"),
                 ("ref", "param_offload"))
OFFLOAD_STAGES = (4, 7)  # first the gradient and optimizer offloads, then also the parameters


def cuda_total_bytes() -> int | None:
    """Total memory of this process's CUDA device (LOCAL_RANK), or None where CUDA is not in use."""
    import torch  # deferred: torch; megarl.run and the planner import this module without it

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()).total_memory


@dataclass(frozen=True)
class ColocatedMemory:
    """Bytes per GPU while the rollout engine generates, from step 2 on."""

    training_state: float  # parameters, gradients, optimizer state left on the GPU (max over pipeline stages)
    engine: float  # rollout.gpu_memory_utilization x device
    device: float
    overhead: float = OVERHEAD_BYTES
    weight_sync_copy: float = 0.0  # rollout.weight_sync.mode=delta: what was last synced, kept on the GPU

    @property
    def total(self) -> float:
        return self.training_state + self.weight_sync_copy + self.engine + self.overhead

    @property
    def fits(self) -> bool:
        return self.total <= self.device


def roles(cfg: Config) -> list[str]:
    """The training engines a run builds."""
    alg = cfg.algorithm
    return (["actor"] + (["critic"] if alg.adv_estimator == "gae" else [])
            + (["ref"] if alg.use_kl_in_reward or cfg.actor.use_kl_loss else []))


def _offload_flags(cfg: Config, role: str) -> tuple[bool, bool, bool]:
    section = getattr(cfg, role)
    if role == "ref":
        return bool(section.param_offload), False, False
    return bool(section.param_offload), bool(section.grad_offload), bool(section.optimizer_offload)


def estimate(cfg: Config, world_size: int, device_bytes: float) -> ColocatedMemory | None:
    """The estimate for `cfg` as its offloads stand (null = off); None when the planner does not
    know the model (no config.json yet, or a family it does not read)."""
    _, lay, _ = planner_inputs(cfg)  # the planner's layout of this config, as `megarl.tools.plan` reads it
    run = RunShape(dtype=cfg.model.dtype, gpu_memory_fraction=cfg.rollout.gpu_memory_utilization, weight_sync=cfg.rollout.weight_sync.mode)
    archs = {}
    for role in roles(cfg):
        path = os.path.join((cfg.critic.model_path if role == "critic" else None) or cfg.model.path, "config.json")
        try:
            archs[role] = arch_from_config(load_config(path))
        except (OSError, ValueError):
            return None
    try:
        dp, edp = check(archs["actor"], lay, Cluster(world_size, world_size, GPU("this device", device_bytes / GIB, 0, 0, 0)))
    except ValueError:
        return None  # validation reports the layout
    resident = 0.0
    for stage in range(lay.pp):
        held = 0.0
        for role, arch in archs.items():
            st = engine_state(arch, lay, stage, run, dp, edp, role)
            held += st.total() - offloaded_bytes(st, role, *_offload_flags(cfg, role))
        resident = max(resident, held)
    copy = weight_sync_delta(sync_bytes(archs["actor"], lay, world_size, dp)["megarl_bytes_per_gpu"], run)["weight_sync_copy_bytes_per_gpu"]
    return ColocatedMemory(training_state=resident, engine=cfg.rollout.gpu_memory_utilization * device_bytes,
                           device=device_bytes, weight_sync_copy=copy)


def _with(cfg: Config, settings: dict[tuple[str, str], bool]) -> Config:
    changes: dict[str, dict[str, bool]] = {}
    for (role, key), value in settings.items():
        changes.setdefault(role, {})[key] = value
    return dataclasses.replace(cfg, **{role: dataclasses.replace(getattr(cfg, role), **kv) for role, kv in changes.items()})


def _nulls_off(cfg: Config) -> Config:
    return _with(cfg, {(role, key): False for role, key in OFFLOAD_ORDER if getattr(getattr(cfg, role), key) is None})


def check_colocated_memory(cfg: Config, world_size: int, device_bytes: float | None = None) -> tuple[Config, str | None]:
    """`cfg` with every null offload decided, and a line saying what was turned on (None if
    nothing). Raises ConfigError (one line naming the knobs) when even the offloads left to it do
    not make the colocated engine fit. `device_bytes`: the device's memory (default: this CUDA
    device's; without CUDA, or with engine hf, there is nothing to check)."""
    r = cfg.rollout
    # under rollout.placement=fleet the engine runs on the servers: nothing of it beside the training state
    if not r.memory_check or r.engine not in ("vllm", "sglang") or r.placement == "fleet":
        return _nulls_off(cfg), None
    if device_bytes is None:
        device_bytes = cuda_total_bytes()
        if device_bytes is None:
            return _nulls_off(cfg), None
    mine = [(role, key) for role, key in OFFLOAD_ORDER if role in roles(cfg) and getattr(getattr(cfg, role), key) is None]
    candidate = _nulls_off(cfg)
    first = estimate(candidate, world_size, device_bytes)
    if first is None or first.fits:
        return candidate, None
    best = first
    for stage in OFFLOAD_STAGES:
        turned = [rk for rk in mine if OFFLOAD_ORDER.index(rk) < stage]
        if not turned:
            continue
        candidate = _with(_nulls_off(cfg), {rk: True for rk in turned})
        best = estimate(candidate, world_size, device_bytes)
        if best.fits:
            names = ", ".join(f"{role}.{key}" for role, key in turned)
            return candidate, (f"megarl: memory check: colocated rollout.engine={r.engine} would need {first.total / GIB:.1f} GiB "
                               f"of {device_bytes / GIB:.1f} GiB per GPU from step 2 (training state with optimizer moments "
                               f"{first.training_state / GIB:.1f} + gpu_memory_utilization {r.gpu_memory_utilization:g}); turned "
                               f"on {names} ({best.total / GIB:.1f} GiB); set them to true/false to decide yourself")
    raise ConfigError(refusal(cfg, best, device_bytes))


def refusal(cfg: Config, est: ColocatedMemory, device_bytes: float) -> str:
    """The one line that stops the run: the arithmetic and the knobs that would help."""
    r = cfg.rollout
    room = (device_bytes - est.training_state - est.weight_sync_copy - est.overhead) / device_bytes
    fixes = []
    if room >= 0.05:
        fixes.append(f"lower rollout.gpu_memory_utilization to {int(room * 100) / 100:.2f} or less")
    offs = [f"{role}.{key}=true" for role, key in OFFLOAD_ORDER
            if role in roles(cfg) and getattr(getattr(cfg, role), key) is False]  # set false by the user
    if offs:
        fixes.append("set " + " ".join(offs))
    fixes.append("or spread the model over more GPUs (parallel.tp / parallel.pp)")
    if est.weight_sync_copy:
        fixes.append("or set rollout.weight_sync.mode=full")
    copy = (f" + {est.weight_sync_copy / GIB:.1f} GiB of rollout.weight_sync.mode=delta's copy" if est.weight_sync_copy else "")
    return (f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g}: the colocated {r.engine} engine would not fit from "
            f"step 2: {est.training_state / GIB:.1f} GiB of training state left on each GPU while it generates (optimizer "
            f"moments included){copy} + {r.gpu_memory_utilization:g} x {device_bytes / GIB:.1f} GiB + {est.overhead / GIB:g} GiB "
            f"overhead = {est.total / GIB:.1f} GiB > {device_bytes / GIB:.1f} GiB; {'; '.join(fixes)} "
            f"(rollout.memory_check=false skips this estimate)")
