"""Issue 28's fixed costs of a train step: no collective over a group of one, a dense model's forward
and backward outside the CPU device-rewrite mode, torch's fused Adam (layout-invariant)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algorithms import policy_loss
from megarl.engine import solo_groups
from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
from megarl.platform import cpu_compat


def test_all_reduce_over_a_group_of_one_is_not_issued(monkeypatch):
    calls = []
    all_reduce = solo_groups._solo_all_reduce(lambda t, op, group, async_op: calls.append((group, async_op)) or "work")
    t = torch.tensor([3.0])
    monkeypatch.setattr(solo_groups, "_group_size", lambda group: {"one": 1, "two": 2}[group])
    assert all_reduce(t, group="one") is None and calls == [] and t.tolist() == [3.0]
    assert all_reduce(t, group="two") == "work" and calls == [("two", False)]
    assert all_reduce(t, group="one", async_op=True) == "work"  # a handle is expected: passed through


def test_bucket_collective_over_a_group_of_one_copies_only_when_the_shard_is_not_the_buffer(monkeypatch):
    calls = []
    gather = solo_groups._solo_bucket_collective(lambda out, inp, **kw: calls.append(kw))
    monkeypatch.setattr(solo_groups, "_group_size", lambda group: 1)
    buffer = torch.arange(6.0)
    gather(buffer, buffer[0:6], group="one")  # Megatron's shard at dp 1: the very same memory
    other = torch.zeros(6)
    gather(other, buffer, group="one")
    assert calls == [] and other.tolist() == buffer.tolist()


def test_fused_adam_is_bitwise_the_same_under_any_sharding():
    """Each parameter whole (tp 1) or split in 2 or 3 shards (tp 2, 3): the same updated weights."""
    shapes = [(23, 64), (64,), (192, 64), (37,), (7, 3)]

    def run(shards: int) -> torch.Tensor:
        full = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
        params = [q.clone().requires_grad_() for p in full for q in p.chunk(shards)]
        opt = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0, foreach=False, fused=True)
        g = torch.Generator().manual_seed(99)
        for _ in range(4):
            grads = [torch.randn(s, generator=g) for s in shapes]
            for p, grad in zip(params, [q for gr in grads for q in gr.chunk(shards)]):
                p.grad = grad.clone()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in params])

    whole = run(1)
    assert torch.equal(whole, run(2)) and torch.equal(whole, run(3))


def test_train_step_runs_a_dense_model_outside_the_mode_with_fused_adam_and_no_collective(tiny_models, world_of_one, monkeypatch):
    cpu_compat.apply()  # as on any CPU run (idempotent)
    engine = MegatronEngine(str(tiny_models["llama"]), world_of_one, EngineConfig(optim=OptimConfig(lr=1e-2)))
    inner = engine.optimizer.optimizer
    assert all(group["fused"] and not group["foreach"] for group in inner.param_groups)
    modes_in_forward = []
    engine.module.register_forward_pre_hook(lambda m, a: modes_in_forward.append(len(torch.overrides._get_current_function_mode_stack())))
    issued = []
    original = dist.all_reduce.__wrapped__
    monkeypatch.setattr(dist, "all_reduce", solo_groups._solo_all_reduce(lambda *a, **k: issued.append(k) or original(*a, **k)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (4, 9), generator=g).tolist()
    batch = SequenceBatch(ids, [5] * 4, list(range(4)), 4, {"response_mask": torch.ones(4, 4), "advantages": torch.randn(4, 4, generator=g),
                                                           "old_logprobs": torch.full((4, 4), -5.0)})
    before = [p.detach().clone() for p in engine.module.parameters()]

    def loss_fn(out, mb, totals):
        return policy_loss(out.logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mb.response_mask, global_tokens=totals.tokens)

    stats = engine.train_step(batch, loss_fn, fields=("old_logprobs", "advantages"), mini_batches=2)
    assert modes_in_forward == [0, 0]  # both mini-batches' forwards ran without the device-rewrite mode
    assert len(cpu_compat_stack()) == 1  # and it is back afterwards
    assert issued == []  # world size 1: no all-reduce reached gloo
    assert len(stats.grad_norms) == 2 and all(torch.isfinite(torch.tensor(stats.grad_norms)))
    assert any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))


def cpu_compat_stack():
    return [m for m in torch.overrides._get_current_function_mode_stack() if isinstance(m, cpu_compat.CudaToCpuMode)]
