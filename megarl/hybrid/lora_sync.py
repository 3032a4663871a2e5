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

`megarl.rollout.vllm_lora.adapter_sync_reason` decides whether the path applies (build time, from the
config alone).
"""
from __future__ import annotations

import dataclasses
import time

from megarl.hybrid.engine import SyncStats, release_cached_device_memory, streamed_shards
from megarl.models import lora


class AdapterSync:
    """hand_over for the adapter-only path; the same signature and SyncStats as HybridEngine's."""

    def __init__(self, actor, options: lora.LoraOptions, base_model: str):
        self.actor, self.options, self.base_model = actor, options, base_model
        self.base_sent = False
        self.last_adapter_bytes = 0

    def base_shards(self):
        """The actor's frozen base weights, unmerged (the engine adds the adapters itself)."""
        return streamed_shards(self.actor.base_weight_shards(), self.actor.spec.tie_embeddings)

    def hand_over(self, hybrid, engine, offload):
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
