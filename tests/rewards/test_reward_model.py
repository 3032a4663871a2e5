"""reward.kind=model: scores equal transformers' *ForSequenceClassification on the same text."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from megarl.tools.make_tiny_model import make_tiny_model

    base = make_tiny_model("llama", tmp_path_factory.mktemp("base") / "m", tokenizer="digits")
    out = tmp_path_factory.mktemp("rm") / "rm"
    torch.manual_seed(3)
    model = LlamaForSequenceClassification.from_pretrained(base, num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.config.pad_token_id = 0
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def test_reward_model_scores_match_transformers(reward_model_dir, world_of_one):
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from megarl.rewards.model import RewardModel

    rm = RewardModel(str(reward_model_dir), world_of_one)
    prompts, responses = ["12=", "472=", "9+9="], ["12", "47", "18;"]
    scores = rm(prompts, responses, ["", "", ""], ["x"] * 3, [{}] * 3)
    hf = LlamaForSequenceClassification.from_pretrained(reward_model_dir)
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    with torch.no_grad():
        expected = [hf(torch.tensor([tok.encode(p + r)])).logits[0, 0].item() for p, r in zip(prompts, responses)]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == 3  # distinct texts, distinct scores


def test_reward_model_without_scalar_head_is_refused(tiny_models, world_of_one):
    from megarl.rewards.model import RewardModel

    with pytest.raises(ValueError, match="score.weight"):
        RewardModel(str(tiny_models["llama"]), world_of_one)
