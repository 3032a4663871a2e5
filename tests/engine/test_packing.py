"""Sequence packing: packed micro-batches give Hugging Face's per-sequence numbers, as padded ones do."""
from __future__ import annotations

import pytest
import torch

from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine

R = 6  # response slots


def ragged_batch(n: int = 7) -> SequenceBatch:
    """Prompts of 2..9 tokens and responses of 1..6: packing removes real padding here."""
    g = torch.Generator().manual_seed(7)
    seqs, prompt_lens = [], []
    mask = torch.zeros(n, R)
    for i in range(n):
        p, r = int(torch.randint(2, 10, (1,), generator=g)), int(torch.randint(1, R + 1, (1,), generator=g))
        seqs.append(torch.randint(0, 301, (p + r,), generator=g).tolist())
        prompt_lens.append(p)
        mask[i, :r] = 1
    return SequenceBatch(seqs, prompt_lens, list(range(n)), R, {"response_mask": mask})


def hf_reference(model_dir, batch: SequenceBatch) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {"logprobs": torch.zeros(len(batch), R), "entropy": torch.zeros(len(batch), R)}
    with torch.no_grad():
        for i, seq in enumerate(batch.input_ids):  # one sequence at a time: no padding at all
            ids = torch.tensor([seq])
            logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
            p, r = batch.prompt_lens[i], int(batch.response_mask[i].sum())
            span = slice(p - 1, p - 1 + r)
            out["logprobs"][i, :r] = logp[span].gather(-1, ids[0, 1:, None][span])[:, 0]
            out["entropy"][i, :r] = -(logp[span].exp() * logp[span]).sum(-1)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_packed_forward_matches_transformers_per_sequence(family, tiny_models, world_of_one):
    batch = ragged_batch()
    expected = hf_reference(tiny_models[family], batch)
    for packing in (True, False):
        # A 24-token budget splits the batch into several micro-batches either way.
        engine = MegatronEngine(str(tiny_models[family]), world_of_one,
                                EngineConfig(max_tokens_per_microbatch=24, sequence_packing=packing), trainable=False)
        got = engine.forward_only(batch, entropy=True)
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(getattr(got, key), expected[key], rtol=0, atol=2e-5, msg=f"{key}, packing={packing}")


def test_packed_and_padded_critic_values_agree(tiny_models, world_of_one):
    batch = ragged_batch()
    values = [
        MegatronEngine(str(tiny_models["qwen2"]), world_of_one, EngineConfig(max_tokens_per_microbatch=24, sequence_packing=p),
                       value_head=True, trainable=False).forward_only(batch).values
        for p in (True, False)
    ]
    assert values[0].abs().sum() > 0
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=1e-5)


def test_packed_micro_batches_carry_only_tail_padding(tiny_models, world_of_one):
    engine = MegatronEngine(str(tiny_models["qwen2"]), world_of_one,
                            EngineConfig(max_tokens_per_microbatch=24, sequence_packing=True), trainable=False)
    batch = ragged_batch(16)
    real = sum(len(s) for s in batch.input_ids)
    packed = engine._micro_batches(batch, list(range(len(batch))))
    engine.cfg.sequence_packing = False
    padded = engine._micro_batches(batch, list(range(len(batch))))
    tokens = lambda mbs: sum(mb["input_ids"].numel() for mb in mbs)  # noqa: E731
    assert all(mb["input_ids"].shape == (1, 24) for mb in packed)  # 24: the budget, a multiple of 8
    assert tokens(packed) - real < 8 * len(packed) <= tokens(padded) - real


def test_length_groups_are_computed_once_per_micro_batch(tiny_models, world_of_one, monkeypatch):
    """Packed attention's length groups (host syncs: .tolist(), int()) come from cu_seqlens, the same
    for every layer: one computation per micro-batch, not one per layer (audit F9); results unchanged."""
    import megarl.models.packed_attention as packed_attention

    calls = []
    real = packed_attention._compute_length_groups
    monkeypatch.setattr(packed_attention, "_compute_length_groups", lambda *a: calls.append(1) or real(*a))
    batch = ragged_batch()  # lengths 3..15: several length groups
    engine = MegatronEngine(str(tiny_models["llama"]), world_of_one,
                            EngineConfig(max_tokens_per_microbatch=4096, sequence_packing=True), trainable=False)
    assert engine.spec.num_layers >= 2
    got = engine.forward_only(batch, )
    assert len(calls) == 1  # one micro-batch (the budget holds the whole batch), every layer reuses it
    expected = hf_reference(tiny_models["llama"], batch)
    torch.testing.assert_close(got.logprobs, expected["logprobs"], rtol=0, atol=2e-5)


def test_rope_fusion_follows_transformer_engine(world_of_one, monkeypatch):
    """TE's fused RoPE (thd: one kernel instead of a per-sequence host loop per layer) wherever TE's
    layers are used; never on the CPU path, never for MLA."""
    import dataclasses

    import megatron.core.transformer as mt

    import megarl.models.builder as builder
    from megarl.models.families import ModelSpec

    spec = ModelSpec(family="llama", architecture="LlamaForCausalLM", vocab_size=40, hidden_size=16, ffn_hidden_size=32,
                     num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=64, tie_embeddings=False)
    assert builder.build_transformer_config(spec, world_of_one).apply_rope_fusion is False  # CPU: no TE

    class Built(Exception):
        pass

    def capture(**kwargs):  # TE's fused kernels cannot be built here: stop at the config's arguments
        raise Built(kwargs)

    monkeypatch.setattr(builder, "uses_transformer_engine", lambda: True)  # as on a GPU with TE
    monkeypatch.setattr(mt, "TransformerConfig", capture)
    with pytest.raises(Built) as built:
        builder.build_transformer_config(spec, world_of_one)
    assert built.value.args[0]["apply_rope_fusion"] is True
    assert builder.rope_fusion(dataclasses.replace(spec, mla=object()), use_te=True) is False
