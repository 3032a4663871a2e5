"""Production-path defects that only a GPU run would hit, shown here on CPU (issue 12, item 8)."""
from __future__ import annotations

import sys
import types

import pytest
import torch


def test_have_transformer_engine_probes_the_pytorch_extension(monkeypatch):
    """`import transformer_engine` succeeds when its torch extension is broken; the layers do not."""
    from megarl.models.builder import have_transformer_engine

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)  # its import raises ImportError
    assert have_transformer_engine() is False

    broken = types.ModuleType("transformer_engine.pytorch")
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", broken)
    sys.modules["transformer_engine"].pytorch = broken
    assert have_transformer_engine() is True


def test_moe_router_gemm_name_is_defined_on_gpu_without_transformer_engine(monkeypatch):
    """megatron's router reads `te_general_gemm` whenever it exists; without TE the name was only
    defined by the CPU layer, so init_platform on a GPU left every MoE forward raising NameError."""
    import megarl.platform as platform
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(platform, "_PLATFORM", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("MEGARL_FORCE_CPU", "0")
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    chosen = platform.init_platform()
    assert chosen.backend == "nccl"
    assert moe_utils.te_general_gemm is None  # the router then takes its torch.mm branch


def test_loading_fails_loudly_when_a_parameter_has_no_checkpoint_mapping(world_of_one, tiny_models, monkeypatch):
    import megarl.models.weights as weights
    from megarl.models import load_model

    load_model(str(tiny_models["qwen2"]), world_of_one)  # every parameter is mapped: loads
    real = weights.weight_mappings

    def drifted(spec, tp):  # as if a family's names drifted: one weight no longer maps
        return [m for m in real(spec, tp) if m.name != "decoder.final_layernorm.weight"]

    monkeypatch.setattr(weights, "weight_mappings", drifted)
    with pytest.raises(ValueError, match=r"decoder\.final_layernorm\.weight.*random weights|no checkpoint mapping.*final_layernorm"):
        load_model(str(tiny_models["qwen2"]), world_of_one)


def test_a_critic_value_head_is_still_exempt(world_of_one, tiny_models):
    from megarl.models import load_model

    model, _ = load_model(str(tiny_models["qwen2"]), world_of_one, critic=True)
    assert model is not None
