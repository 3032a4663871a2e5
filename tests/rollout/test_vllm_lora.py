"""megarl.rollout.vllm_lora without vLLM: the rank rounding, the engine options, and what one
adapter slot asks of vLLM per sync (the real engine runs it in tests/vllm/test_lora_sync.py)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

from megarl.rollout.vllm import VLLMConfig, engine_kwargs
from megarl.rollout.vllm_lora import AdapterSlot, max_lora_rank


def test_rank_rounds_up_to_a_slot_vllm_accepts():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 32, 33, 300, 512)] == [1, 8, 8, 16, 32, 64, 320, 512]
    with pytest.raises(ValueError, match="above vLLM's largest max_lora_rank 512"):
        max_lora_rank(513)


def test_engine_options_turn_lora_on_only_when_asked():
    assert "enable_lora" not in engine_kwargs(VLLMConfig(hf_dir="m"), 0)
    kw = engine_kwargs(VLLMConfig(hf_dir="m", lora_rank=4), 0)
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 8, 1)


@dataclass
class _Request:  # vllm.lora.request.LoRARequest's fields megarl uses
    lora_name: str
    lora_int_id: int
    lora_path: str


class _RecordingLLM:
    """Records the calls; reads the adapter directory at add_lora as vLLM's loader does."""

    def __init__(self):
        self.calls = []
        self.llm_engine = self

    def add_lora(self, request):
        with open(os.path.join(request.lora_path, "adapter_config.json")) as f:
            self.calls.append(("add", request.lora_int_id, json.load(f)["r"]))

    def remove_lora(self, lora_id):
        self.calls.append(("remove", lora_id))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))


def test_each_sync_replaces_the_adapter_under_a_fresh_id():
    llm = _RecordingLLM()
    slot = AdapterSlot(llm, _Request)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 16),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(16, 4, dtype=torch.bfloat16)}
    assert slot.load(tensors, {"r": 4}) == 4 * 16 * 4 + 16 * 4 * 2
    first = slot.request.lora_path
    assert slot.load(tensors, {"r": 4}) == 384
    assert llm.calls == [("add", 1, 4), ("reset",), ("remove", 1), ("add", 2, 4), ("reset",)]
    assert slot.request.lora_int_id == 2 and not os.path.exists(first)  # the old adapter's files are gone
    with pytest.raises(ValueError, match="no adapter tensors"):
        slot.load({}, {"r": 4})
    slot.close()
    assert not os.path.exists(slot.request.lora_path)


def test_the_adapter_path_applies_only_where_vllm_can_take_the_adapters():
    from megarl.rollout.vllm_lora import adapter_sync_reason

    assert adapter_sync_reason("vllm", 8, None, is_moe=False) is None  # every linear of a dense model
    assert adapter_sync_reason("vllm", 8, ["q_proj", "o_proj"], is_moe=True) is None  # attention of a MoE model
    assert "not synced to vLLM as a LoRA" in adapter_sync_reason("vllm", 8, None, is_moe=True)  # expert / MLP adapters
    assert "not synced to vLLM as a LoRA" in adapter_sync_reason("vllm", 8, ["q_proj", "gate_proj"], is_moe=True)
    assert "above vLLM's largest max_lora_rank 512" in adapter_sync_reason("vllm", 1024, None, is_moe=False)
    assert "rollout.engine=hf has no LoRA support" in adapter_sync_reason("hf", 8, None, is_moe=False)
    assert adapter_sync_reason("vllm", 0, None, is_moe=False) == "actor.lora is off"
