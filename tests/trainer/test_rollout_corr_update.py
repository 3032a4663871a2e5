"""MIS's rejection through the real update (Megatron engine, one rank): training on the batch whose
rejected sequence left the actor's response mask (megarl.step.step_record.StepRecord.actor_batch) gives the
gradient and loss of training on the batch without that sequence, so a rejected sample leaves the
loss's denominator as well as its numerator (verl's rejection semantics)."""
from __future__ import annotations

import pytest
import torch

from conftest import make_model
from megarl.algorithms import compute_rollout_correction, policy_loss
from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
from megarl.engine.batch import LossBatch, ModelOutputs, Totals
from megarl.step.step_record import Correction, LossInputs, Scores, StepRecord, fields_of

pytestmark = [pytest.mark.slow]  # two Megatron engines with optimizers: 31 s measured on the loaded 2-core box

R = 4


def _batch(rows):
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 301, (3 + R,), generator=g).tolist() for _ in range(4)]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)
    old = -torch.rand(4, R, generator=g) * 3 * mask
    # sequence 1's ratio pi_old / pi_rollout is e^3, far outside MIS's [0.5, 2]: rejected
    rollout = old - torch.tensor([[0.1, -0.1, 0.05, 0.0], [1.5, 1.5, 0, 0], [0.2, -0.3, 0.1, 0], [-0.2, 0, 0, 0]]) * mask
    adv = torch.randn(4, R, generator=g) * mask
    m = mask[rows]
    batch = SequenceBatch([seqs[i] for i in rows], [3] * len(rows), list(range(len(rows))), R, {"response_mask": m})
    return batch, old[rows], adv[rows], rollout[rows]


def _record(batch, old, adv, corr: Correction) -> StepRecord:
    mask = batch.response_mask
    return StepRecord(batch=batch, response_mask=mask, scored=Scores(old, old),
                      scores=torch.zeros(len(batch)), token_rewards=mask, advantages=adv, returns=adv, correction=corr)


def _loss_fn(o: ModelOutputs, mb: LossBatch, t: Totals):
    x = LossInputs.of(mb)
    loss, metrics = policy_loss(o.logprobs, x.old_logprobs, x.advantages, x.response_mask,
                                rollout_is_weights=x.rollout_is_weights, global_tokens=t.tokens, global_seqs=t.seqs)
    return loss, {"loss": float(loss.detach()) * t.tokens / max(float(x.response_mask.sum()), 1.0)}


def _update(model_dir, world, record: StepRecord):
    engine = MegatronEngine(str(model_dir), world, EngineConfig(dtype="float32", optim=OptimConfig(lr=1e-3)), seed=0)
    batch = record.actor_batch(kl_loss=False)
    stats = engine.train_step(batch, _loss_fn, fields=fields_of(batch))
    return stats.grad_norms[0], stats.metrics["loss"]


def test_a_rejected_sequence_leaves_numerator_and_denominator(tmp_path, world_of_one):
    model = make_model(tmp_path / "llama", "llama", vocab_size=301, tie=True, seed=0)
    full, old, adv, rollout = _batch([0, 1, 2, 3])
    corr = compute_rollout_correction(old, rollout, full.response_mask, "mis")
    assert corr.masked.any(-1).tolist() == [False, True, False, False]
    full_record = _record(full, old, adv, Correction(corr.weights, corr.loss_mask))
    kept, kept_old, kept_adv, kept_rollout = _batch([0, 2, 3])
    kept_weights = compute_rollout_correction(kept_old, kept_rollout, kept.response_mask, "mis").weights
    norm_full, loss_full = _update(model, world_of_one, full_record)
    norm_kept, loss_kept = _update(model, world_of_one, _record(kept, kept_old, kept_adv, Correction(kept_weights)))
    assert norm_full == pytest.approx(norm_kept, rel=1e-5) and norm_full > 0
    assert loss_full == pytest.approx(loss_kept, rel=1e-5)
