"""After a HybridEngine sync from a Megatron actor, the hf engine generates what transformers
generates from the same actor exported as an HF checkpoint: a dense (tied) and an MoE family,
from (tp 2), (pp 2) and (tp 2 x pp 2) training layouts."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _transformers_greedy(export_dir: str, prompts, max_new_tokens: int = 8) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    out = []
    for ids in prompts:
        seq = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        out.append(seq[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("nproc,layouts", [(2, ["2,1", "1,2"]), (4, ["2,2"])], ids=["tp2-pp2", "tp2xpp2"])
def test_hf_engine_after_sync_matches_transformers(tiny_models, tmp_path, nproc, layouts):
    from actor_sync_worker import PROMPTS

    out = tmp_path / "results.json"
    models = [str(tiny_models["llama"]), str(tiny_models["qwen3_moe"])]
    torchrun(nproc, ["tests/hybrid/actor_sync_worker.py", "--models", *models, "--layouts", *layouts,
                     "--out", str(out), "--tmp", str(tmp_path)])
    results = json.loads(out.read_text())
    assert len(results) == 2 * len(layouts)
    for r in results:
        where = f"{r['model']} tp={r['tp']} pp={r['pp']}"
        assert r["ranks_agree"], where
        assert r["sync_bytes"] > 0, where
        assert r["engine_tokens"] == _transformers_greedy(r["export"], PROMPTS), where
