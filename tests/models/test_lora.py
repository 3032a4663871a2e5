"""LoRA in the Megatron model (megarl.models.lora) against a plain PyTorch LoRA on the transformers
model: the same loss and the same adapter gradients (within 1e-5), for a dense model, a MoE model
(expert adapters against transformers' fused expert tensors) and multi-latent attention with shared
experts; the base frozen; adapters off = the base model; merged weights = the adapted model."""
from __future__ import annotations

import pytest
import torch

from lora_reference import megarl_adapter_params, random_adapters, reference_grads

RANK, ALPHA = 4, 8.0


def _megarl_loss(model, spec, tokens, weights):
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    logits = model(tokens, positions, None)[..., : spec.vocab_size]
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return (logprobs * weights).sum()


def _check(model_dir, dims, targets=None):
    from megarl.models import load_model, lora

    model, spec = load_model(model_dir, dims)
    model.double()  # float64 on both sides: what differs is the LoRA math, not float32 rounding
    options = lora.LoraOptions(rank=RANK, alpha=ALPHA, target_modules=targets)
    assert lora.apply([model], spec, dims, options) > 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora." in n for n in trainable), trainable
    model.eval()  # no dropout; autograd still runs
    params = megarl_adapter_params([model], spec, dims)
    if targets is not None:
        assert {n.rsplit(".", 1)[1] for n in params} == set(targets)
    values = random_adapters({n: (b.shape[0], a.shape[1]) for n, (a, b) in params.items()}, RANK, seed=3)
    with torch.no_grad():
        for n, (a, b) in params.items():
            a.copy_(values[n][0])
            b.copy_(values[n][1])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (2, 10), generator=g)
    weights = torch.randn(2, 9, generator=g, dtype=torch.float64)
    loss = _megarl_loss(model, spec, tokens, weights)
    loss.backward()
    names = spec.hf_names
    ref_loss, ref = reference_grads(str(model_dir), values, ALPHA / RANK, tokens, weights,
                                    (names.expert_gate, names.expert_up, names.expert_down))
    assert abs(float(loss) - float(ref_loss)) < 1e-4 * max(1.0, abs(float(ref_loss)))
    assert set(ref) == set(params)
    worst, compared = [], 0
    for n, (a, b) in params.items():
        for ours, theirs, which in ((a.grad, ref[n][0], "A"), (b.grad, ref[n][1], "B")):
            if theirs.abs().max() == 0:  # an expert no token was routed to
                assert ".experts." in n and ours.abs().max() == 0, f"{n}.lora_{which}"
                continue
            compared += 1
            # relative to the gradient's size: float32 sums over the sequence and vocabulary
            err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
            worst.append(err)
            assert err < 1e-5, f"{n}.lora_{which}: gradient differs from the reference by {err} (relative)"
    assert compared >= len(params), f"only {compared} of {2 * len(params)} gradients are non-zero"
    print(f"{model_dir.name}: {len(params)} adapters, worst relative gradient difference {max(worst):.2e}")
    # adapters off: the base model, bit for bit
    with torch.no_grad():
        with lora.disabled([model]):
            off = _megarl_loss(model, spec, tokens, weights)
        for _, module, adapter in lora.adapters([model]):
            adapter.enabled = False
        base = _megarl_loss(model, spec, tokens, weights)
        for _, module, adapter in lora.adapters([model]):
            adapter.enabled = True
        assert float(off) == float(base) and abs(float(off) - float(loss)) > 1e-3
        # merged weights (float32 merge) compute the adapted model
        merged = lora.merged_weights([model], spec, dims)
        named = {id(p): n for n, p in model.named_parameters()}
        saved = {}
        for _, module, _ in lora.adapters([model]):
            saved[module] = module.weight.detach().clone()
        from megarl.models.weights import named_global_parameters

        by_name = {n: p for n, _, p in named_global_parameters([model], spec, dims)}
        for n, t in merged.items():
            by_name[n].copy_(t)
        with lora.disabled([model]):
            merged_loss = _megarl_loss(model, spec, tokens, weights)
        for module, w in saved.items():
            module.weight.copy_(w)
        assert abs(float(merged_loss) - float(loss)) < 1e-4 * max(1.0, abs(float(loss))), (float(merged_loss), float(loss))
        del named


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_lora_gradients_match_reference(tiny_models, world_of_one, arch):
    _check(tiny_models[arch], world_of_one)


def test_lora_mla_shared_experts(tiny_moe_671b_models, world_of_one):
    _check(tiny_moe_671b_models["deepseek_v3"], world_of_one)


def test_lora_target_subset(tiny_models, world_of_one):
    _check(tiny_models["qwen3_moe"], world_of_one, targets=["k_proj", "up_proj", "o_proj"])


def test_unknown_target_refused(tiny_models, world_of_one):
    from megarl.models import load_model, lora

    model, spec = load_model(tiny_models["llama"], world_of_one)
    with pytest.raises(ValueError, match="actor.lora.target_modules: qkv not in this llama model"):
        lora.apply([model], spec, world_of_one, lora.LoraOptions(rank=2, target_modules=("qkv",)))
