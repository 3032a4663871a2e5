"""The LoRA actor gives one process's numbers (dp4, which equals one process: tests/engine) under
tp2 x pp2 (a dense llama), etp2 x ep2 and tp2 x ep2 with sequence parallelism (qwen3_moe): the grad
norms of two PPO updates, the log-probs with the adapters, the base model's with them off, and the
merged export. One torchrun launch of 4 ranks for every layout."""
from __future__ import annotations

import pytest
import torch

from conftest import make_model, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# tp2 x ep2 runs with sequence parallelism, which MoE training needs at tp > 1 (and which crashed the
# adapters' forward before they followed it: megarl/models/lora.py).
LAYOUTS = ["0:dp", "0:tp=2,pp=2", "1:dp", "1:ep=2,etp=2", "1:tp=2,ep=2,sequence_parallel=1"]


def _rows(per_dp_rank: dict) -> torch.Tensor:
    """The global batch's rows from each DP rank's share (rank r holds rows r, r + dp, ...)."""
    dp = len(per_dp_rank)
    out = torch.zeros(8, per_dp_rank[0].shape[1])
    for r, t in per_dp_rank.items():
        out[r::dp] = t
    return out


def test_lora_same_numbers_under_every_layout(tmp_path):
    models = [str(make_model(tmp_path / "llama", "llama", vocab_size=301, layers=4, tie=False, seed=5)),
              str(make_model(tmp_path / "qwen3_moe", "qwen3_moe", vocab_size=301, layers=4, seed=6))]
    out = tmp_path / "lora_layouts.pt"
    torchrun(4, ["tests/models/lora_layout_worker.py", "--models", *models, "--layouts", *LAYOUTS, "--out", str(out)],
             timeout=900)
    results = torch.load(out, weights_only=False)
    for index in (0, 1):
        base = results[(index, "dp")]
        assert len(base["grad_norms"]) == 4 and all(n > 0 for n in base["grad_norms"])
        assert base["frozen_without_grad"]
        logp_on, logp_off = _rows(base["on"]), _rows(base["off"])
        assert (logp_on - logp_off).abs().max() > 1e-3  # the adapters trained and change the policy
        for (i, text), r in results.items():
            if i != index or text == "dp":
                continue
            where = f"model {i} {text}"
            assert r["frozen_without_grad"], where
            assert r["grad_norms"] == pytest.approx(base["grad_norms"], rel=1e-4), where
            for key in ("on", "off"):
                got, want = _rows(r[key]), _rows(base[key])
                torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=f"{where} log-probs adapters {key}")
            assert r["merged"].keys() == base["merged"].keys()
            # four Adam steps at lr 1e-2 from float32 gradients that differ in rounding
            for name, t in base["merged"].items():
                torch.testing.assert_close(r["merged"][name], t, rtol=1e-4, atol=1e-4, msg=f"{where} merged {name}")
