"""algorithm.rollout_correction in the trainer (megarl/step/rollout_corr.py) on a one-rank layout: the
mode's weights reach the actor's training batch (megarl.step.step_record.StepRecord.actor_batch), MIS's rejected samples leave the actor's response mask
(so the loss's totals count only what it trains on), the metrics carry verl's names, and a mode
that needs the engine.s scaled (untruncated) log-probs refuses processed ones."""
from __future__ import annotations

import math
import types

import pytest
import torch

from megarl.step import rollout_corr
from megarl.config import load_config
from megarl.engine.batch import SequenceBatch
from megarl.step.global_batch import GlobalBatch
from megarl.step.step_record import Correction, Scores, StepRecord, fields_of


def _rc(*overrides):
    cfg = load_config(None, ["model.path=unused", "data.train_files=[unused]", *overrides])
    return cfg.algorithm.rollout_correction


def _batch():
    """Two responses; ratios pi_old / pi_rollout: sequence 0 [4, 0.5] (prod 2), sequence 1 [0.25, pad]."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rollout = torch.zeros(2, 2)
    old = torch.log(torch.tensor([[4.0, 0.5], [0.25, 1.0]])) * mask
    batch = SequenceBatch([[1, 2, 3], [1, 2]], [1, 1], [0, 1], 2, {"response_mask": mask})
    return batch, old, rollout


def _apply(batch, old, rollout, *overrides, scaled=True) -> Correction:
    return rollout_corr.apply(_rc(*overrides), old, rollout, batch.response_mask, scaled, GlobalBatch(types.SimpleNamespace(dp=1)))


def _actor_batch(batch, old, corr: Correction) -> SequenceBatch:
    """The actor's training batch of a step record holding `corr` (the other fields do not matter here)."""
    mask = batch.response_mask
    record = StepRecord(batch=batch, response_mask=mask, scored=Scores(old, old),
                        scores=torch.zeros(len(batch)), token_rewards=mask, advantages=mask, returns=mask, correction=corr)
    return record.actor_batch(kl_loss=False)


def test_tis_weights_reach_the_actor_and_the_mask_is_unchanged():
    batch, old, rollout = _batch()
    corr = _apply(batch, old, rollout, "algorithm.rollout_correction.mode=tis")
    metrics, trained = corr.metrics, _actor_batch(batch, old, corr)
    assert corr.weights.tolist() == [[2.0, 0.5], [0.25, 0.0]] and corr.loss_mask is None
    assert fields_of(trained) == ("old_logprobs", "advantages", "rollout_is_weights")
    assert trained.tensors["rollout_is_weights"] is corr.weights and trained.response_mask is batch.response_mask
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/kl"] == pytest.approx(-math.log(4 * 0.5 * 0.25) / 3, rel=1e-6)
    assert set(metrics) >= {"rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_min", "rollout_corr/k3_kl",
                            "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_eff_sample_size"}


def test_mis_rejected_sequences_leave_the_actors_response_mask_only():
    batch, old, rollout = _batch()
    corr = _apply(batch, old, rollout, "algorithm.rollout_correction.mode=mis")  # band [0.5, 2]: sequence 1 (0.25) out
    metrics, trained = corr.metrics, _actor_batch(batch, old, corr)
    assert trained.response_mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert batch.response_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]  # advantages, metrics keep the full mask
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)


def test_none_logs_the_mismatch_without_touching_the_batch():
    batch, old, rollout = _batch()
    corr = _apply(batch, old, rollout)
    assert set(corr.metrics) == {"rollout_corr/kl", "rollout_corr/k3_kl"}
    assert corr.weights is None and corr.loss_mask is None
    trained = _actor_batch(batch, old, corr)
    assert fields_of(trained) == ("old_logprobs", "advantages") and trained.response_mask is batch.response_mask


def test_processed_logprobs_are_refused_by_a_correcting_mode_and_skipped_by_none():
    batch, old, rollout = _batch()
    assert _apply(batch, old, rollout, scaled=False) == Correction()  # no weights, no mask, no metrics
    with pytest.raises(RuntimeError, match="mode=icepop needs the engine.s scaled log-probs"):
        _apply(batch, old, rollout, "algorithm.rollout_correction.mode=icepop", scaled=False)


def test_empty_bands_are_refused_at_load():
    from megarl.config import ConfigError

    for overrides in (["algorithm.rollout_correction.mode=mis", "algorithm.rollout_correction.rollout_rs_threshold=0.5"],
                      ["algorithm.rollout_correction.mode=icepop", "algorithm.rollout_correction.icepop_low=6"]):
        with pytest.raises(ConfigError, match="empty band"):
            _rc(*overrides)
