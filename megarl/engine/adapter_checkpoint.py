"""Adapter-only checkpoints of an engine with LoRA (`<role>.lora.rank > 0`).

The base weights are frozen and never change, so a checkpoint holds only what trains -- the
adapters (`...lora.adapters.<proj>.lora_A/lora_B`) and a critic's value head -- with their
optimizer state, the LR scheduler and the RNG states (megarl.engine.checkpointing writes those as
for a full checkpoint), plus `base_ref.json`: the base model's directory and content hash
(megarl.models.base_ref). On load the engine has already been built from its base directory, so
only the adapters and the optimizer are filled in; megarl.run refuses a base whose hash changed
before any model is built.

Megatron's sharded state dict describes the adapter factors as replicated (they are children of
the linear layer, whose `sharded_state_dict` knows only its weight and bias). `describe_tp_splits`
gives the TP-split factor (B of a column-parallel layer, A of a row-parallel one) its global shape
and this rank's offset, so a checkpoint written under one tensor-parallel layout loads under any other.
"""
from __future__ import annotations

from megarl.models import base_ref


def trained_entry(local_key: str, value_head: bool) -> bool:
    """Whether a model state-dict key (prefix "model.") is saved under LoRA: an adapter factor, or
    the value head of a critic (it trains beside the adapters, megarl.models.lora.freeze_base)."""
    return ".lora." in local_key or (value_head and local_key.startswith("model.output_layer."))


def adapter_state(engine, model_state: dict) -> dict:
    """One chunk's model sharded state dict reduced to what a LoRA checkpoint holds."""
    kept = {k: v for k, v in model_state.items() if trained_entry(k, engine.value_head)}
    return describe_tp_splits(engine, kept)


def _split_factors(engine) -> dict[int, tuple[int, int, int]]:
    """id(parameter) -> (axis, tp rank, tp size) of every adapter factor split over its layer's TP group."""
    from megarl.models import lora  # deferred: torch (megarl.models.lora imports it); this module is imported without torch

    split = {}
    for _, _, adapter in lora.adapters(engine.chunks):
        if adapter.tp_size == 1:
            continue
        for part in adapter.adapters.values():
            param, axis = (part.lora_B, 0) if adapter.kind == "column" else (part.lora_A, 1)
            split[id(param)] = (axis, adapter.tp_rank, adapter.tp_size)
    return split


def describe_tp_splits(engine, state: dict) -> dict:
    """The TP-split adapter factors re-described as shards of their global tensor (others unchanged)."""
    from megatron.core.dist_checkpointing import ShardedTensor  # deferred: megatron (seconds to import) loads only when this runs

    split = _split_factors(engine)
    out = {}
    for key, sh in state.items():
        found = split.get(id(getattr(sh, "data", None))) if isinstance(sh, ShardedTensor) else None
        if found is None:
            out[key] = sh
            continue
        axis, rank, size = found
        n = sh.prepend_axis_num
        prepend = [(i, sh.global_offset[i], sh.axis_fragmentations[i]) for i in range(n)]
        # the TP component of the replica id goes to 0: each TP rank holds a distinct shard, its main copy
        replica = (sh.replica_id[0], 0, *sh.replica_id[2:]) if isinstance(sh.replica_id, tuple) else sh.replica_id
        out[key] = ShardedTensor.from_rank_offsets(sh.key, sh.data, *prepend, (n + axis, rank, size), replica_id=replica,
                                                   prepend_axis_num=n)
    return out


def write_base_ref(engine, path: str) -> None:
    """Rank 0: the base this engine's adapters were trained on, into its checkpoint directory."""
    base_ref.write(path, base_ref.fingerprint(engine.model_dir))
