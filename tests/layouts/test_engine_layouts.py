"""The engine with virtual pipeline stages (one model chunk per virtual stage): the PPO update of
interleaved 1F1B equals plain 1F1B's, offload moves every chunk and back bit-exactly, and its
checkpoint loads under other layouts (uneven stages, no pipeline) and trains on identically."""
from __future__ import annotations

import pytest
import torch

from conftest import make_model, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _close(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rel, atol=1e-6, msg=k)


def test_vpp_update_offload_and_checkpoint_across_layouts(tmp_path):
    # untied: checkpoints of tied embeddings under vpp are refused (megarl.engine.checkpointing)
    model = make_model(tmp_path / "llama4", "llama", vocab_size=301, layers=4, tie=False, seed=5)
    out = tmp_path / "engine_layouts.pt"
    torchrun(2, ["tests/layouts/engine_layout_worker.py", "--model", str(model), "--ckpt", str(tmp_path / "ckpt"),
                 "--out", str(out)], timeout=600)
    r = torch.load(out, weights_only=False)
    ref, vpp = r["pp2"], r["vpp"]
    # several micro-batches per mini-batch (a 24-token budget), so interleaving really interleaves
    assert len(vpp["grad_norms"]) == 2 and all(n > 0 for n in vpp["grad_norms"])
    assert vpp["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert vpp["metrics"] == pytest.approx(ref["metrics"], rel=1e-5)
    _close(ref["weights"], vpp["weights"], rel=1e-5)
    assert r["vpp_offload_bit_identical"]
    for name in ("resumed_uneven", "resumed_dp2"):
        _close(r[name]["loaded"], vpp["weights"], rel=0)  # the vpp checkpoint, loaded exactly
    assert r["resumed_uneven"]["grad_norms"] == pytest.approx(r["resumed_dp2"]["grad_norms"], rel=1e-5)
    _close(r["resumed_uneven"]["weights"], r["resumed_dp2"]["weights"], rel=1e-5)
