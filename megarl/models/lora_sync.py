"""The trainer's adapter-only weight sync (rollout engines with LoRA support: vLLM).

The base weights are frozen, so they go to the engine once, unmerged, through the HybridEngine
(the first hand-over); every hand-over, the first included, then sends the actor's adapters only:
the whole adapter on every rank (gathered from the TP/EP/PP shards, megarl.models.lora
`full_adapters`, rank x width per projection), PEFT-named, which the engine applies as a LoRA
(`load_adapter`, megarl.rollout.vllm_lora). Merging into the weights instead (the fallback for
engines without LoRA: megarl.models.lora `merged_shards`) sends the model every step and, in bf16,
rounds the update on the bf16 grid.

Where the engine drops its weights while asleep (vLLM's sleep level 2, on GPU) the base goes again
at every hand-over; on CPU (no sleep mode) and at sleep level 1 it goes once.

`adapter_sync_reason` decides whether the path applies (build time, from the config alone).
"""
from __future__ import annotations

import dataclasses
import time

from megarl.models import lora


def adapter_sync_reason(engine: str, rank: int, targets, is_moe: bool) -> str | None:
    """Why the adapter-only path does not apply, or None when it does."""
    from megarl.models.lora_targets import ATTENTION_PROJECTIONS

    if rank <= 0:
        return "actor.lora is off"
    if engine != "vllm":
        return f"rollout.engine={engine} has no LoRA support in megarl (merged weights are sent)"
    from megarl.rollout.vllm_lora import VLLM_LORA_RANKS

    if rank > VLLM_LORA_RANKS[-1]:
        return f"actor.lora.rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}"
    attention = {name for names in ATTENTION_PROJECTIONS.values() for name in names}
    if is_moe and (targets is None or any(t not in attention for t in targets)):
        # lora.moe_mlp_adapters: the PEFT export writes them in transformers 5's fused-expert layout
        # (megarl.models.lora_peft, peft parameter targets), which vLLM's LoRA loader is not known to take
        return "MLP adapters of a MoE model are not synced to vLLM as a LoRA (target attention only for adapter-only sync)"
    return None


class AdapterSync:
    """hand_over for the adapter-only path; the same signature and SyncStats as HybridEngine's."""

    def __init__(self, actor, options: lora.LoraOptions, base_model: str):
        self.actor, self.options, self.base_model = actor, options, base_model
        self.base_sent = False
        self.last_adapter_bytes = 0

    def base_shards(self):
        """The actor's frozen base weights, unmerged (the engine adds the adapters itself)."""
        a = self.actor
        shards = a.base_weight_shards()
        if a.spec.tie_embeddings:  # as the trainer's _actor_shards: the engine needs the embedding once
            shards.pop("output_layer.weight", None)
        return shards

    def hand_over(self, hybrid, engine, offload):
        from megarl.hybrid.engine import SyncStats, release_cached_device_memory

        start = time.perf_counter()
        base = None
        # vLLM's sleep level 2 (GPU) drops the weights at release_memory: the base goes again then
        if not self.base_sent or not getattr(engine, "_weights_valid", True):
            engine.load_weights(hybrid.stream(self.base_shards()))
            base = dataclasses.replace(hybrid.last_stats)
            self.base_sent = True
        adapters = self.actor.full_adapters()  # collective over the world
        sent = engine.load_adapter(lora.peft_tensors(adapters), lora.peft_config(self.options, adapters, self.base_model))
        self.last_adapter_bytes = sent
        offload()
        release_cached_device_memory()
        engine.resume_memory()
        seconds = time.perf_counter() - start
        if base is None:
            return SyncStats(bytes_received=sent, bytes_sent=0, collectives=1, peak_extra_bytes=sent, seconds=seconds)
        return dataclasses.replace(base, bytes_received=base.bytes_received + sent, collectives=base.collectives + 1, seconds=seconds)
