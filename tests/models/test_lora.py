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
    values = _load_random_adapters(params, seed=3)
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
        for _, _module, adapter in lora.adapters([model]):
            adapter.enabled = False
        base = _megarl_loss(model, spec, tokens, weights)
        for _, _module, adapter in lora.adapters([model]):
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


def _load_random_adapters(params: dict, seed: int) -> dict:
    """Seeded non-zero adapters (lora_reference.random_adapters) copied into megarl's (A, B) pairs."""
    values = random_adapters({n: (b.shape[0], a.shape[1]) for n, (a, b) in params.items()}, RANK, seed=seed)
    with torch.no_grad():
        for n, (a, b) in params.items():
            a.copy_(values[n][0])
            b.copy_(values[n][1])
    return values


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_lora_gradients_match_reference(tiny_models, world_of_one, arch):
    _check(tiny_models[arch], world_of_one)


@pytest.mark.slow  # ~25-45 s on the shared CI cores (MLA, 8 experts, float64 on both sides)
def test_lora_mla_shared_experts(tiny_moe_671b_models, world_of_one):
    _check(tiny_moe_671b_models["deepseek_v3"], world_of_one)


def test_lora_target_subset(tiny_models, world_of_one):
    _check(tiny_models["qwen3_moe"], world_of_one, targets=["k_proj", "up_proj", "o_proj"])


def test_unknown_target_refused(tiny_models, world_of_one):
    from megarl.models import load_model, lora

    model, spec = load_model(tiny_models["llama"], world_of_one)
    with pytest.raises(ValueError, match="actor.lora.target_modules: qkv not in this llama model"):
        lora.apply([model], spec, world_of_one, lora.LoraOptions(rank=2, target_modules=("qkv",)))


def _logprobs(logits, tokens):
    return torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


# (model fixture, name, targets): q/k/v biases beside the adapters (qwen2); routed experts fused by
# transformers 5 into gate_up_proj / down_proj, Mixtral's w1/w3/w2 included; a dense first layer,
# shared experts and multi-latent attention (deepseek_v3); gate_proj left out, so that the fused
# gate_up_proj adapter has zero gate rows and no down_proj wrapper nests around it (the subset)
PEFT_EXPORTS = {
    "qwen2": ("tiny_models", "qwen2", None),
    "mixtral": ("tiny_models", "mixtral", None),
    "qwen3_moe": ("tiny_models", "qwen3_moe", None),
    "qwen3_moe_subset": ("tiny_models", "qwen3_moe", ("k_proj", "up_proj")),
    "deepseek_v3": ("tiny_moe_671b_models", "deepseek_v3", None),
}


@pytest.mark.parametrize("case", list(PEFT_EXPORTS))
def test_peft_adapter_and_merged_export_give_megarl_logprobs(request, world_of_one, tmp_path, case):
    """--adapter-only's PEFT directory, loaded by peft onto the base transformers model, and the merged
    export give megarl's log-probs (float32, 1e-4), dense and MoE MLP adapters alike."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.engine.engine import EngineConfig, MegatronEngine
    from megarl.models import lora

    fixture, name, targets = PEFT_EXPORTS[case]
    model_dir = request.getfixturevalue(fixture)[name]
    options = lora.LoraOptions(rank=RANK, alpha=ALPHA, target_modules=targets)
    engine = MegatronEngine(str(model_dir), world_of_one, EngineConfig(lora=options), trainable=False)
    params = megarl_adapter_params(engine.chunks, engine.spec, world_of_one)
    values = _load_random_adapters(params, seed=5)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, engine.spec.vocab_size, (2, 12), generator=g)
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = _logprobs(engine.module(tokens, positions, None)[..., : engine.spec.vocab_size], tokens)
        with lora.disabled(engine.chunks):
            base_ours = _logprobs(engine.module(tokens, positions, None)[..., : engine.spec.vocab_size], tokens)
    assert (ours - base_ours).abs().max() > 1e-2  # the adapters matter
    engine.save_peft_adapter(tmp_path / "adapter", str(model_dir))  # what megarl.checkpointing.checkpoint --adapter-only calls
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    # every factor loaded, none left at peft's initialisation (B = 0): as many non-zero numbers as
    # megarl's (random, non-zero) factors hold; the fused gate_up_proj's B adds only zero blocks
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    routed = sum(1 for n in params if ".experts." in n and ".shared_experts." not in n)
    assert all(p.abs().max() > 0 for p in loaded.values()), [n for n, p in loaded.items() if p.abs().max() == 0]
    assert sum(int((p != 0).sum()) for p in loaded.values()) == sum(a.numel() + b.numel() for a, b in values.values())
    with torch.no_grad():
        theirs = _logprobs(peft_model(tokens).logits, tokens)
    err = (ours - theirs).abs().max().item()
    print(f"{case}: {len(params)} adapters ({routed} on routed experts), peft vs megarl log-probs {err:.2e}")
    assert err < 1e-4, err
    # the merged export (export_hf's default under LoRA): the same model
    engine.save_hf_checkpoint(tmp_path / "merged", model_dir)  # megarl.checkpointing.checkpoint's export: merged under LoRA
    with torch.no_grad():
        full = _logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)(tokens).logits, tokens)
    assert (full - theirs).abs().max() < 1e-4
