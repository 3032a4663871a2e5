"""ParallelDims: the one place that knows tp / pp / dp / cp / ep and owns the process groups.

Megatron-Core's global parallel state is initialised here, once, and the rest of megarl asks this
object for its groups and ranks. Rank order is Megatron's default "tp-cp-ep-dp-pp": tensor-parallel
ranks are consecutive, pipeline stages are the slowest-moving coordinate.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
import socket

import torch
import torch.distributed as dist

from megarl.layout import ParallelLayout, rollout_blocks
from megarl.platform import current_platform, fake_world, init_platform, process_groups


_DEGREES = ("world_size", "tp", "pp", "cp", "ep", "etp", "vpp", "first_stage_layers", "last_stage_layers", "sequence_parallel")


@dataclass
class ParallelDims:
    """Parallel degrees of one training job and their process groups. `dp` is derived: world_size /
    (tp * pp * cp); the arithmetic (checks, stage layers, rank map) is `self.layout`'s
    (megarl.layout.ParallelLayout), this class adds Megatron's process groups.

    tp: tensor parallel; pp: pipeline parallel; cp: context parallel; ep: expert parallel (MoE);
    etp: expert tensor parallel (None = same as tp, Megatron's default); vpp: virtual pipeline
    stages per rank (None or 1 = no interleaving); first_stage_layers / last_stage_layers: layers
    of the first / last pipeline stage when they differ from the others (Megatron's
    num_layers_in_first/last_pipeline_stage; None = an even share); sequence_parallel: Megatron's
    sequence parallelism over the tp group (`parallel.sequence_parallel`; off at tp 1). Off by default
    here, where tools and tests build layouts directly; the run config turns it on at tp > 1.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    sequence_parallel: bool = False
    _initialized: bool = field(default=False, repr=False)

    def __post_init__(self):
        if self.vpp == 1:  # one virtual stage per rank is the plain 1F1B schedule
            self.vpp = None
        self.sequence_parallel = bool(self.sequence_parallel) and self.tp > 1  # nothing to split at tp 1
        self.validate()

    # --- arithmetic: megarl.layout.ParallelLayout's -------------------------------------------------
    @property
    def layout(self) -> ParallelLayout:
        """The torch-free layout (degrees, stage layers, rank map) these process groups realise: built
        once from the degrees (they do not change after construction: see __setattr__)."""
        return self._layout

    def validate(self) -> None:
        """ValueError with the layout arithmetic's message; holds the layout it built."""
        object.__setattr__(self, "_layout", ParallelLayout.for_world(
            self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp, vpp=self.vpp,
            first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
            sequence_parallel=self.sequence_parallel))

    def __setattr__(self, name: str, value) -> None:
        # The degrees are fixed once the layout is built from them: a changed degree would leave the
        # process groups and the layout describing another job.
        if "_layout" in self.__dict__ and name in _DEGREES and value != getattr(self, name):
            raise AttributeError(f"ParallelDims.{name} is fixed once built (build a new ParallelDims for another layout)")
        super().__setattr__(name, value)

    @property
    def model_parallel_size(self) -> int:
        return self.layout.model_parallel_size

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def expert_tp(self) -> int:
        return self.layout.expert_tp

    @property
    def chunks_per_stage(self) -> int:
        """Model chunks each pipeline rank holds: vpp with interleaving, else 1."""
        return self.layout.chunks_per_stage

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Layers of each pipeline stage for a model of `num_layers`; ValueError shows the arithmetic."""
        return self.layout.stage_layer_counts(num_layers)

    def chunk_layers(self, num_layers: int) -> dict[tuple[int, int], range]:
        """Global layers of every model chunk, keyed (pp_rank, vp_stage) (ParallelLayout.chunk_layers)."""
        return self.layout.chunk_layers(num_layers)

    def layer_owner(self, layer: int, num_layers: int) -> tuple[int, int]:
        """(pp_rank, vp_stage) of the chunk that holds global layer `layer`."""
        return self.layout.layer_owner(layer, num_layers)

    def describe(self) -> str:
        return self.layout.describe()

    # --- process groups --------------------------------------------------------------------------
    def initialize(self, backend: str | None = None, timeout_minutes: int = 30, seed: int = 1234) -> "ParallelDims":
        """Start torch.distributed (if needed), build Megatron's process groups and RNG states."""
        # deferred: megatron (seconds to import) loads only when this runs
        from megatron.core import parallel_state, tensor_parallel

        platform = init_platform()
        backend = backend or platform.backend
        if not dist.is_initialized():
            if "RANK" not in os.environ:  # plain `python script.py`: a world of one
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(_free_port()))
                os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was built for world size {self.world_size} but torch.distributed has "
                f"{dist.get_world_size()} processes"
            )
        if parallel_state.model_parallel_is_initialized():
            self.destroy()
        # what c10d held before Megatron's groups: destroy() destroys the groups initialize_model_parallel
        # made, which a process that goes on after this run (a test world, a user's launcher) would
        # otherwise keep; groups made later (the rollout engine's, vLLM's own) are their owners' to end
        before = process_groups.registered_groups()
        with fake_world.gloo_groups_on_fake():  # the dry run's world of any size (megarl.tools.dryrun)
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=self.tp,
                pipeline_model_parallel_size=self.pp,
                virtual_pipeline_model_parallel_size=self.vpp,
                context_parallel_size=self.cp,
                expert_model_parallel_size=self.ep,
                expert_tensor_parallel_size=self.etp,
                distributed_timeout_minutes=timeout_minutes,
            )
        # Megatron's named RNG states (per TP rank, per EP rank); weights come from checkpoints and
        # dropout is off, so these only matter for optional random init.
        self._groups_made = process_groups.registered_groups() - before
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self._initialized = True
        return self

    @property
    def initialized(self) -> bool:
        """Whether initialize() has built this layout's process groups."""
        return self._initialized

    def _state(self):
        if not self._initialized:
            raise RuntimeError("ParallelDims.initialize() must be called before asking for groups")
        from megatron.core import parallel_state  # deferred: megatron (seconds to import) loads only when this runs

        return parallel_state

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def tp_rank(self) -> int:
        return self._state().get_tensor_model_parallel_rank()

    @property
    def pp_rank(self) -> int:
        return self._state().get_pipeline_model_parallel_rank()

    @property
    def dp_rank(self) -> int:
        return self._state().get_data_parallel_rank()

    @property
    def cp_rank(self) -> int:
        return self._state().get_context_parallel_rank()

    @property
    def cp_group(self):
        return self._state().get_context_parallel_group()

    @property
    def ep_rank(self) -> int:
        return self._state().get_expert_model_parallel_rank()

    @property
    def etp_rank(self) -> int:
        return self._state().get_expert_tensor_parallel_rank()

    @property
    def tp_group(self):
        return self._state().get_tensor_model_parallel_group()

    @property
    def pp_group(self):
        return self._state().get_pipeline_model_parallel_group()

    @property
    def dp_group(self):
        return self._state().get_data_parallel_group()

    @property
    def dp_cp_group(self):
        return self._state().get_data_parallel_group(with_context_parallel=True)

    @property
    def ep_group(self):
        return self._state().get_expert_model_parallel_group()

    @property
    def etp_group(self):
        return self._state().get_expert_tensor_parallel_group()

    @property
    def mp_group(self):
        return self._state().get_model_parallel_group()

    @property
    def batch_group(self):
        """The ranks that share this rank's data-parallel batch: the model-parallel group (tp x pp)
        and, under context parallelism (pp 1 there), the CP ranks: Megatron's tensor-and-context group."""
        if self.cp == 1:
            return self.mp_group
        if self.pp != 1:
            raise NotImplementedError("context parallelism with pipeline parallelism is not built")
        return self._state().get_tensor_and_context_parallel_group()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def pp_stage_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline group, stage 0 first."""
        return dist.get_process_group_ranks(self.pp_group)

    def coordinates(self) -> dict[str, int]:
        return dict(rank=self.rank, tp=self.tp_rank, pp=self.pp_rank, dp=self.dp_rank, ep=self.ep_rank, etp=self.etp_rank)

    def all_coordinates(self) -> list[dict[str, int]]:
        """Every rank's coordinates, indexed by global rank (one all_gather_object on the world)."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, self.coordinates())
        return out

    # --- rollout groups ---------------------------------------------------------------------------
    def rollout_groups(self, tp: int) -> "RolloutGroups":
        """This rank's rollout engine instance: `tp` consecutive global ranks, the order vLLM's
        external_launcher (blocks [k*tp, (k+1)*tp) of the default group) and SGLang (base_gpu_id + r)
        impose. Created once per tp (a collective: every rank calls it, in the same order)."""
        self._state()
        cache = self.__dict__.setdefault("_rollout_groups", {})
        if tp not in cache:
            cache[tp] = RolloutGroups.consecutive(tp)
        return cache[tp]

    def destroy(self) -> None:
        forget_megatron_models()
        made = self.__dict__.pop("_groups_made", None)
        if made and dist.is_initialized():
            process_groups.destroy_groups(made)  # Megatron's (collective-free: each rank ends its own)
        self._initialized = False


def forget_megatron_models() -> None:
    """Megatron's parallel state reset, and what Megatron caches of the models built on it dropped, so
    that the models, and through them their process groups and gloo threads, can be freed: a run closed
    in a process that goes on (a test world, a user's own launcher) otherwise leaves each rank ~50
    threads per run, every idle gloo TCP loop waking each 10 ms. Called by ParallelDims.destroy, and
    by the test worlds after a job that built Megatron's state itself (a worker script)."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    # destroy_model_parallel forgets these two (Megatron-Core 0.16 to 0.19)
    for name in ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO"):
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)
    # RotaryEmbedding.forward and YarnRotaryEmbedding.forward (MLA) are lru_caches over `self` (32
    # entries each): they kept the last models' rotary modules alive
    for rotary in _rotary_embeddings():
        clear = getattr(rotary.forward, "cache_clear", None)
        if clear is not None:
            clear()


def _rotary_embeddings() -> tuple:
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    return RotaryEmbedding, YarnRotaryEmbedding


@dataclass(frozen=True)
class RolloutGroups:
    """One rollout engine instance seen from this rank: its process group (None when size 1),
    its global ranks (consecutive), this rank's position in it (its rollout TP rank), and which
    instance it is (index, the ExternalDP replica number)."""

    size: int
    group: object | None
    ranks: tuple[int, ...]
    rank: int
    index: int

    @staticmethod
    def consecutive(size: int) -> "RolloutGroups":
        rank, mine = dist.get_rank(), None
        for index, ranks in enumerate(rollout_blocks(dist.get_world_size(), size)):  # every block on every rank, in order
            group = dist.new_group(list(ranks)) if size > 1 else None
            if rank in ranks:
                mine = RolloutGroups(size, group, ranks, ranks.index(rank), index)
        return mine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dims_from_env(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None, vpp: int | None = None,
                  first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                  sequence_parallel: bool = False) -> ParallelDims:
    """ParallelDims for the world torchrun started (WORLD_SIZE), or a world of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return ParallelDims(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp,
                        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                        sequence_parallel=sequence_parallel)


# --- collectives on small host tensors ----------------------------------------------------------
# Metrics, counts and per-token tensors live on the host, but NCCL only moves device tensors: these
# helpers take the detour through the platform's device (a no-op on CPU / gloo).


def _comm_device() -> torch.device:
    return current_platform().device


def all_reduce_host(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = t.to(_comm_device())
    dist.all_reduce(x, op=op, group=group)
    return x.cpu()


def all_gather_host(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    x = t.contiguous().to(_comm_device())
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return [p.cpu() for p in parts]


def broadcast_host(t: torch.Tensor, src: int, group) -> torch.Tensor:
    x = t.contiguous().to(_comm_device())
    dist.broadcast(x, src=src, group=group)
    return x.cpu()
