"""algorithm.rollout_correction in the trainer (megarl/rollout_corr.py) on a one-rank layout: the
mode's weights reach the actor's fields, MIS's rejected samples leave the actor's response mask
(so the loss's totals count only what it trains on), the metrics carry verl's names, and a mode
that needs untruncated engine log-probs refuses processed ones."""
from __future__ import annotations

import math
import types

import pytest
import torch

from megarl import rollout_corr
from megarl.config import load_config
from megarl.engine.batch import SequenceBatch
from megarl.global_batch import GlobalBatch


def _rc(*overrides):
    cfg = load_config(None, ["model.path=unused", "data.train_files=[unused]", *overrides])
    return cfg.algorithm.rollout_correction


def _batch():
    """Two responses; ratios pi_old / pi_rollout: sequence 0 [4, 0.5] (prod 2), sequence 1 [0.25, pad]."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rollout = torch.zeros(2, 2)
    old = torch.log(torch.tensor([[4.0, 0.5], [0.25, 1.0]])) * mask
    batch = SequenceBatch([[1, 2, 3], [1, 2]], [1, 1], [0, 1], 2, {"response_mask": mask, "old_logprobs": old})
    return batch, rollout


def _apply(batch, rollout, *overrides, raw=True):
    return rollout_corr.apply(_rc(*overrides), batch, rollout, raw, GlobalBatch(types.SimpleNamespace(dp=1)))


def test_tis_weights_reach_the_actor_and_the_mask_is_unchanged():
    batch, rollout = _batch()
    metrics = _apply(batch, rollout, "algorithm.rollout_correction.mode=tis")
    assert batch.tensors[rollout_corr.WEIGHTS].tolist() == [[2.0, 0.5], [0.25, 0.0]]
    assert rollout_corr.actor_fields(batch) == (rollout_corr.WEIGHTS,)
    assert rollout_corr.actor_batch(batch) is batch
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(4 * 0.5 * 0.25) / 3, rel=1e-6)
    assert set(metrics) >= {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_min", "rollout_corr/k3_kl",
                            "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_eff_sample_size"}


def test_mis_rejected_sequences_leave_the_actors_response_mask_only():
    batch, rollout = _batch()
    metrics = _apply(batch, rollout, "algorithm.rollout_correction.mode=mis")  # band [0.5, 2]: sequence 1 (0.25) out
    trained = rollout_corr.actor_batch(batch)
    assert trained.response_mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert batch.response_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]  # advantages, metrics keep the full mask
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)


def test_none_logs_the_mismatch_without_touching_the_batch():
    batch, rollout = _batch()
    metrics = _apply(batch, rollout)
    assert set(metrics) == {"rollout_corr/kl", "rollout_corr/k3_kl"}
    assert rollout_corr.actor_fields(batch) == () and rollout_corr.actor_batch(batch) is batch


def test_processed_logprobs_are_refused_by_a_correcting_mode_and_skipped_by_none():
    batch, rollout = _batch()
    assert _apply(batch, rollout, raw=False) == {}
    with pytest.raises(RuntimeError, match="mode=icepop needs the engine's untruncated log-probs"):
        _apply(batch, rollout, "algorithm.rollout_correction.mode=icepop", raw=False)


def test_empty_bands_are_refused_at_load():
    from megarl.config import ConfigError

    for overrides in (["algorithm.rollout_correction.mode=mis", "algorithm.rollout_correction.rollout_rs_threshold=0.5"],
                      ["algorithm.rollout_correction.mode=icepop", "algorithm.rollout_correction.icepop_low=6"]):
        with pytest.raises(ConfigError, match="empty band"):
            _rc(*overrides)
