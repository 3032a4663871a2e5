"""`ParallelLayout`: the degrees of a training job, their arithmetic and Megatron-Core's rank map.

Rank order is Megatron-Core's default "tp-cp-ep-dp-pp": for the dense (non-expert) layers
    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)),
and experts are carved out of the tp x cp x dp ranks of each pipeline stage, in the order
etp-ep-edp (expert tensor parallel fastest), as `parallel_state.initialize_model_parallel` builds
its expert rank generator. Context-parallel ranks hold replicas of the weights, so a weight's
"replica" index is `cp_rank + cp * dp_rank` (the dp x cp group DDP averages over).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankCoords:
    """One global rank's coordinates in every parallel dimension (experts: etp, ep, edp)."""

    pp: int
    tp: int
    dp: int
    ep: int
    cp: int = 0
    etp: int = 0
    edp: int = 0


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None, vpp: int | None = 1) -> list[range]:
    """Layers of each pipeline stage: `first`/`last` layers on the end stages (Megatron's
    num_layers_in_first/last_pipeline_stage), the rest split evenly; with `vpp` virtual stages each
    stage's layers must also cut into vpp equal chunks. ValueError shows the arithmetic. The one
    copy of Megatron-Core's rules (TransformerConfig)."""
    vpp = vpp or 1
    if pp == 1:
        if first not in (None, num_layers) or last not in (None, num_layers):
            raise ValueError("first/last stage layers need pp > 1")
        return [range(num_layers)]
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages and (rest == 0 or rest % middle_stages)):
        raise ValueError(f"{num_layers} layers do not split over pp={pp}: first stage {first}, last stage {last}, "
                         f"{rest} layers left for {middle_stages} stages; choose first/last stage layers so that "
                         f"num_layers - first - last is a positive multiple of the other stages")
    if vpp > 1 and middle_stages == 0:
        # Megatron-Core 0.16's get_transformer_layer_offset divides by the middle stages under vpp
        raise ValueError(f"with vpp={vpp}, pp={pp} has no middle stage when both first and last stage layers are set; "
                         f"set only one of them (the other stage takes the rest)")
    per = rest // middle_stages if middle_stages else 0
    sizes = [per] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    bad = [(stage, n) for stage, n in enumerate(sizes) if n % vpp]
    if bad:
        raise ValueError(f"pipeline stage {bad[0][0]} has {bad[0][1]} layers, not divisible by vpp={vpp} (each stage is "
                         f"cut into vpp equal model chunks); stage layers: {sizes}")
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel degrees of one training job; world_size = tp * pp * cp * dp (derived).

    tp: tensor parallel; pp: pipeline parallel; dp: data parallel; ep: expert parallel (MoE);
    cp: context parallel; etp: expert tensor parallel (None = tp, Megatron's default); vpp:
    virtual pipeline stages per rank (None = no interleaving; 1 is normalised to None);
    first_stage_layers / last_stage_layers: layers of the first / last pipeline stage when they
    differ from the others (None = an even share); sequence_parallel: Megatron's sequence
    parallelism over the tp group (norms, dropout and the MoE router on s/tp tokens; normalised to
    False at tp 1, where there is nothing to split). `ParallelLayout.for_world` derives dp from a
    world size. Construction checks the degrees (ValueError naming the parallel.* key).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    etp: int | None = None
    vpp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.vpp == 1:  # one virtual stage per rank is the plain 1F1B schedule
            object.__setattr__(self, "vpp", None)
        if self.tp == 1:  # Megatron-Core refuses sequence_parallel at tp 1; there is nothing to split
            object.__setattr__(self, "sequence_parallel", False)
        self._check()

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None,
                  vpp: int | None = None, first_stage_layers: int | None = None,
                  last_stage_layers: int | None = None, sequence_parallel: bool = False) -> "ParallelLayout":
        """The layout of `world_size` ranks, dp derived; ValueError shows the arithmetic."""
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)):
            _positive(name, value)
        mp = tp * pp * cp
        if world_size % mp:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {mp}; launch a "
                             f"multiple of {mp} processes or change parallel.tp / parallel.pp / parallel.cp")
        return cls(tp=tp, pp=pp, dp=world_size // mp, ep=ep, cp=cp, etp=etp, vpp=vpp,
                   first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                   sequence_parallel=sequence_parallel)

    def _check(self) -> None:
        _positive("dp", self.dp)
        check_degrees(self.tp, self.pp, self.cp, self.ep, self.etp, self.vpp, self.first_stage_layers, self.last_stage_layers)
        # Experts are laid out over etp x ep x expert-dp inside each pipeline stage.
        per_stage, expert_mp = self.tp * self.cp * self.dp, self.expert_tp * self.ep
        if per_stage % expert_mp:
            raise ValueError(f"world size {self.world_size} / pp {self.pp} = {per_stage} ranks per pipeline stage is not "
                             f"divisible by etp*ep = {self.expert_tp}*{self.ep} = {expert_mp}")

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the weights: tp * pp * cp (cp ranks are weight replicas
        that split the sequence)."""
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Data-parallel replicas of each expert: tp * cp * dp / (etp * ep)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def chunks_per_stage(self) -> int:
        """Model chunks each pipeline rank holds: vpp with interleaving, else 1."""
        return self.vpp or 1

    @property
    def uneven_stages(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def describe(self) -> str:
        ep = f" ep={self.ep} etp={self.expert_tp}" if self.ep > 1 or self.etp else ""
        vpp = f" vpp={self.vpp}" if self.vpp else ""
        uneven = "".join(f" {name}={getattr(self, name)}" for name in ("first_stage_layers", "last_stage_layers")
                         if getattr(self, name) is not None)
        sp = " sp" if self.sequence_parallel else ""
        return f"world={self.world_size} tp={self.tp}{sp} pp={self.pp}{vpp}{uneven} cp={self.cp} dp={self.dp}{ep}"

    # --- layers ----------------------------------------------------------------------------------
    def stage_layers(self, num_layers: int) -> list[range]:
        """Global layers of each pipeline stage; ValueError naming this layout when they do not split."""
        try:
            return stage_layers(num_layers, self.pp, self.first_stage_layers, self.last_stage_layers, self.vpp)
        except ValueError as err:
            raise ValueError(f"parallel layout {self.describe()}: {err}") from None

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        return [len(r) for r in self.stage_layers(num_layers)]

    def chunk_layers(self, num_layers: int) -> dict[tuple[int, int], range]:
        """Global layers of every model chunk, keyed (pp_rank, vp_stage). Megatron's order: chunk v
        of every stage before chunk v + 1, so with pp2 x vpp2 over 8 layers stage 0 holds 0-1 and
        4-5 (get_transformer_layer_offset)."""
        counts = self.stage_layer_counts(num_layers)
        v = self.chunks_per_stage
        out, start = {}, 0
        for vp in range(v):
            for pp_rank, n in enumerate(counts):
                out[(pp_rank, vp)] = range(start, start + n // v)
                start += n // v
        return out

    def layer_owner(self, layer: int, num_layers: int) -> tuple[int, int]:
        """(pp_rank, vp_stage) of the chunk that holds global layer `layer`."""
        for key, layers in self.chunk_layers(num_layers).items():
            if layer in layers:
                return key
        raise ValueError(f"layer {layer} is outside a model of {num_layers} layers")

    # --- rank map (Megatron's "tp-cp-ep-dp-pp") --------------------------------------------------
    def rank_of(self, pp: int, tp: int, dp: int, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} = tp {self.tp} x pp {self.pp} x cp {self.cp} "
                             f"x dp {self.dp}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        i = rank % (self.tp * self.cp * self.dp)  # position inside the pipeline stage
        etp, ep, edp = i % self.expert_tp, (i // self.expert_tp) % self.ep, i // (self.expert_tp * self.ep)
        return RankCoords(pp=pp, tp=tp, dp=dp, ep=ep, cp=cp, etp=etp, edp=edp)

    def replica(self, rank: int) -> int:
        """Which dense-weight replica `rank` belongs to: cp_rank + cp * dp_rank."""
        c = self.coords(rank)
        return c.cp + self.cp * c.dp

    def model_parallel_ranks(self, dp: int, cp: int = 0) -> list[int]:
        """The tp * pp ranks that together hold one copy of the (dense) model, ordered by mp rank."""
        return [self.rank_of(p, t, dp, cp) for p in range(self.pp) for t in range(self.tp)]

    def mp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c.tp + self.tp * c.pp


def check_degrees(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None, vpp: int | None = None,
                  first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> None:
    """The checks of the degrees that need no world size (ValueError naming the parallel.* key)."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        _positive(name, value)
    if etp is not None and (not isinstance(etp, int) or etp < 1):
        raise ValueError(f"parallel.etp must be a positive integer or unset, got {etp!r}")
    if vpp is not None and vpp != 1 and (not isinstance(vpp, int) or vpp < 1 or pp == 1):
        raise ValueError(f"parallel.vpp = {vpp} needs parallel.pp > 1 and vpp >= 1 (virtual stages interleave pipeline stages)")
    for name, layers in (("first_stage_layers", first_stage_layers), ("last_stage_layers", last_stage_layers)):
        if layers is not None and (not isinstance(layers, int) or layers < 1):
            raise ValueError(f"parallel.{name} must be a positive integer or unset, got {layers!r}")
        if layers is not None and pp == 1:
            raise ValueError(f"parallel.{name} = {layers} needs parallel.pp > 1 (one stage holds every layer)")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
