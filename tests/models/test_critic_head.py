"""The critic's value head starts at a sane scale: values of about 0.01, not the rewards' size."""
from __future__ import annotations

import torch

from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine


def test_fresh_value_head_predicts_about_zero(tiny_models, world_of_one):
    # The final norm makes hidden states of about unit RMS, so values = w . h have a standard deviation
    # of about ||w|| = 0.01 (megarl.models.critic.VALUE_HEAD_INIT_STD). The former N(0, 1/(hidden+1)) head gave about 1 (0.75 RMS on
    # the CPU demo), as large as the rewards, which made PPO's first advantages the critic's noise.
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 301, (12,), generator=g).tolist() for _ in range(16)]
    batch = SequenceBatch(seqs, [6] * 16, list(range(16)), 6, {"response_mask": torch.ones(16, 6)})
    critic = MegatronEngine(str(tiny_models["qwen2"]), world_of_one, EngineConfig(), value_head=True, trainable=False)
    values = critic.forward_only(batch).values
    rms = values.pow(2).mean().sqrt().item()
    assert 0.003 < rms < 0.03, rms
