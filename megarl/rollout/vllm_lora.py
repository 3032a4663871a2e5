"""Adapter-only weight sync into vLLM: the actor's LoRA factors run as a vLLM LoRA.

Merging adapters into the weights for the rollout engine sends the whole model every step and, in
bf16, distorts the policy (the merge rounds the small update on the bf16 grid). Here the base
weights are loaded once (unmerged, through `load_weights`) and every later sync hands vLLM only
the adapter: PEFT-named tensors (`base_model.model.<HF module>.lora_A.weight`, megarl.models.lora
`peft_tensors`) and a PEFT config, which vLLM applies with its own LoRA kernels (PunicaWrapperCPU
on CPU) to every request.

vLLM 0.32/0.33 loads a LoRA only from a PEFT directory (`LoRARequest.lora_path`; its loader reads
adapter_config.json and adapter_model.safetensors). The adapter is written to a private directory,
under /dev/shm where it exists (memory, not disk), registered with `add_lora` under a fresh id at
sync time (so a malformed adapter fails the sync, not a later generate), and the previous one is
removed: vLLM's LRU cache would otherwise keep serving a stale adapter under a reused id.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile

from safetensors.torch import save_file
import torch

from megarl.models.lora_targets import ATTENTION_PROJECTIONS

# vLLM's LoRAConfig.max_lora_rank is one of these (MaxLoRARanks); an adapter of a smaller rank runs
# in a slot of the next size up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; "
                     "lower actor.lora.rank or use rollout.weight_sync=full (merged weights)")


def lora_engine_kwargs(rank: int) -> dict:
    """LLM(...) options for one adapter of rank `rank` at a time (the actor's)."""
    return dict(enable_lora=True, max_lora_rank=max_lora_rank(rank), max_loras=1, max_cpu_loras=1)


def adapter_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """What one adapter sync sends: the bytes of its tensors."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_peft_dir(path: str, tensors: dict[str, torch.Tensor], config: dict) -> int:
    """A PEFT adapter directory vLLM's LoRA loader reads; returns the tensor bytes written."""
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return adapter_bytes(tensors)


def _scratch_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class AdapterSlot:
    """One vLLM engine's current adapter: `load` replaces it, `request` is what generate passes."""

    def __init__(self, llm, lora_request_cls):
        self._llm, self._request_cls = llm, lora_request_cls
        self._dir = tempfile.mkdtemp(prefix="megarl-lora-", dir=_scratch_root())
        self.version = 0
        self.request = None
        self.last_bytes = 0

    @classmethod
    def for_llm(cls, llm, vllm) -> "AdapterSlot":
        """The slot of an LLM built with lora_engine_kwargs (`vllm`: the imported module)."""
        return cls(llm, importlib.import_module(vllm.__name__ + ".lora.request").LoRARequest)

    @staticmethod
    def required(slot: "AdapterSlot | None") -> "AdapterSlot":
        if slot is None:
            raise RuntimeError("load_adapter needs an engine built with VLLMConfig.lora_rank > 0 (vLLM's enable_lora)")
        return slot

    @staticmethod
    def request_of(slot: "AdapterSlot | None"):
        """generate's lora_request: the current adapter, or None (the base model)."""
        return slot.request if slot is not None else None

    def load(self, tensors: dict[str, torch.Tensor], config: dict) -> int:
        """Write, register and activate the adapter; returns the bytes sent (the adapter's)."""
        if not tensors:
            raise ValueError("adapter sync with no adapter tensors: is actor.lora on and target_modules non-empty?")
        version = self.version + 1
        path = os.path.join(self._dir, str(version))
        nbytes = write_peft_dir(path, tensors, config)
        engine = self._llm.llm_engine
        if self.request is not None:  # one slot (max_loras=1): the old adapter goes first
            engine.remove_lora(self.request.lora_int_id)
            shutil.rmtree(self.request.lora_path, ignore_errors=True)
            self.request = None
        request = self._request_cls(lora_name=f"megarl-actor-{version}", lora_int_id=version, lora_path=path)
        engine.add_lora(request)  # vLLM reads and checks it now
        self._llm.reset_prefix_cache()
        self.request, self.version, self.last_bytes = request, version, nbytes
        return nbytes

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def adapter_sync_reason(engine: str, rank: int, targets, is_moe: bool) -> str | None:
    """Why the adapter-only path does not apply, or None when it does."""
    if rank <= 0:
        return "actor.lora is off"
    if engine != "vllm":
        return f"rollout.engine={engine} has no LoRA support in megarl (merged weights are sent)"
    if rank > VLLM_LORA_RANKS[-1]:
        return f"actor.lora.rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}"
    attention = {name for names in ATTENTION_PROJECTIONS.values() for name in names}
    if is_moe and (targets is None or any(t not in attention for t in targets)):
        # lora.moe_mlp_adapters: the PEFT export writes them in transformers 5's fused-expert layout
        # (megarl.models.lora_peft, peft parameter targets), which vLLM's LoRA loader is not known to take
        return "MLP adapters of a MoE model are not synced to vLLM as a LoRA (target attention only for adapter-only sync)"
    return None
