"""The engine's optimizer step (grads prepared and their norm taken once, then clip and Adam) leaves
exactly the weights Megatron's own optimizer.step() leaves, clipping engaged."""
from __future__ import annotations

import torch

from megarl.algorithms import policy_loss
from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig


def batch() -> SequenceBatch:
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 300, (int(torch.randint(4, 9, (1,), generator=g)) + 4,), generator=g).tolist() for _ in range(6)]
    plens = [len(s) - 4 for s in seqs]
    return SequenceBatch(seqs, plens, list(range(6)), 4, {"response_mask": torch.ones(6, 4),
                                                           "advantages": torch.randn(6, 4, generator=g)})


def megatron_step(engine, skip_above, stats):
    """The former path: norm for the report, then optimizer.step() (which prepares, norms, clips)."""
    found_inf = engine.optimizer.prepare_grads()
    grad_norm = float("nan") if found_inf else float(engine.optimizer.get_grad_norm())
    engine.optimizer.step()
    engine.scheduler.step(increment=1)
    engine.optimizer_steps += 1
    return grad_norm


def test_optimizer_step_equals_megatrons(tiny_models, world_of_one):
    data = batch()
    data.tensors["old_logprobs"] = torch.zeros(6, 4) - 5.0

    def loss_fn(out, mb, totals):
        return policy_loss(out.logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mb.response_mask, global_tokens=totals.tokens)

    weights, norms = [], []
    for reference in (False, True):
        engine = MegatronEngine(str(tiny_models["llama"]), world_of_one,
                                EngineConfig(optim=OptimConfig(lr=1e-2, max_grad_norm=0.05)))
        initial = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        if reference:
            engine._optimizer_step = lambda skip, stats, e=engine: megatron_step(e, skip, stats)
        stats = engine.train_step(data, loss_fn, fields=("old_logprobs", "advantages"), mini_batches=2)
        norms.append(stats.grad_norms)
        weights.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
        assert not all(torch.equal(initial[n], w) for n, w in weights[-1].items())  # the steps moved weights
    assert len(norms[0]) == 2 and min(norms[0]) > 0.05  # clipping engaged at both steps
    assert norms[0] == norms[1]
    for name in weights[1]:
        assert torch.equal(weights[0][name], weights[1][name]), name
