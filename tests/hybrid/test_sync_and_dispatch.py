"""Sync into the hf engine, post-sync verification, and prompt dispatch on 2 gloo processes:
seeded samples are identical whether 1 rank generates everything or 2 rollout DP ranks share it."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import spawn
from megarl.rollout.hf import HFRolloutEngine
from sync_worker import SAMPLING, requests, run

pytestmark = pytest.mark.multiprocess


def test_sync_verify_and_dispatch_on_two_processes(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = str(tiny_models["llama"])
    spawn(run, 2, model_dir, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))

    # reference: one process, the source model, every prompt in one batch
    reference = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    expected = [[r.prompt_index, r.sample_index, r.response_token_ids] for r in reference.generate(requests(range(6)), SAMPLING)]
    assert r0["tp"] == r1["tp"] == expected  # both training TP ranks get the whole DP batch back
    assert r0["dp"] == expected[:6] and r1["dp"] == expected[6:]  # each DP rank gets its own prompts
    assert r0["max_diff"] < 1e-4 and r1["max_diff"] < 1e-4
    assert r0["bytes_received"] > 0
    assert "rollout engine and actor disagree after weight sync" in r0["caught"]
