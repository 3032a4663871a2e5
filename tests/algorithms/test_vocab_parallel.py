"""Log-probs, entropy and full KL from vocab-parallel logits: single process against log_softmax, and
2 gloo processes each holding half the vocabulary against the single-process values and gradients."""
import math

import pytest
import torch
import torch.distributed as dist

from conftest import spawn
from megarl.algorithms import full_kl_penalty
from megarl.models.vocab_parallel import vocab_parallel_entropy, vocab_parallel_full_kl, vocab_parallel_logprobs

F64 = torch.float64


def _reference(logits, ref_logits, targets, true_vocab_size):
    """Plain full-vocabulary definitions on the unpadded columns."""
    logp_all = logits[..., :true_vocab_size].log_softmax(-1)
    logq_all = ref_logits[..., :true_vocab_size].log_softmax(-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    kl = (logp_all.exp() * (logp_all - logq_all)).sum(-1)
    return logp, entropy, kl


def _data(padded_vocab, true_vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, padded_vocab, generator=g, dtype=F64) * 3
    ref_logits = logits + torch.randn(2, 3, padded_vocab, generator=g, dtype=F64)
    logits[..., true_vocab_size:] = 50.0  # padding columns with huge logits must not leak in
    targets = torch.randint(0, true_vocab_size, (2, 3), generator=g)
    weights = torch.randn(3, 2, 3, generator=g, dtype=F64)  # a different weight per output and token
    return logits, ref_logits, targets, weights


def _weighted(logp, entropy, kl, weights):
    return (weights[0] * logp + weights[1] * entropy + weights[2] * kl).sum()


def _values_and_grads(fn_logits, fn_ref, targets, weights, true_vocab_size, tp_group=None, reference=False):
    logits = fn_logits.clone().requires_grad_(True)
    ref_logits = fn_ref.clone().requires_grad_(True)
    if reference:
        outs = _reference(logits, ref_logits, targets, true_vocab_size)
    else:
        kw = dict(tp_group=tp_group, true_vocab_size=true_vocab_size)
        outs = (
            vocab_parallel_logprobs(logits, targets, **kw),
            vocab_parallel_entropy(logits, **kw),
            vocab_parallel_full_kl(logits, ref_logits, **kw),
        )
    _weighted(*outs, weights).backward()
    return [o.detach() for o in outs], logits.grad, ref_logits.grad


@pytest.mark.parametrize("padded_vocab, true_vocab_size", [(10, None), (12, 10)])
def test_single_process_matches_log_softmax(padded_vocab, true_vocab_size):
    logits, ref_logits, targets, weights = _data(padded_vocab, true_vocab_size or padded_vocab)
    got, grad, ref_grad = _values_and_grads(logits, ref_logits, targets, weights, true_vocab_size)
    want, want_grad, want_ref_grad = _values_and_grads(
        logits, ref_logits, targets, weights, true_vocab_size or padded_vocab, reference=True
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad[..., :10], want_grad[..., :10], rtol=0, atol=1e-12)
    torch.testing.assert_close(ref_grad[..., :10], want_ref_grad[..., :10], rtol=0, atol=1e-12)
    assert torch.count_nonzero(grad[..., 10:]) == 0 and torch.count_nonzero(ref_grad[..., 10:]) == 0


def test_hand_worked_uniform_and_bf16():
    # 4 equal logits: log p = -ln 4 for any target, entropy ln 4, KL to itself 0.
    logits = torch.zeros(1, 4, dtype=torch.bfloat16)
    logp = vocab_parallel_logprobs(logits, torch.tensor([2]))
    assert logp.dtype == torch.float32  # bf16 is computed in float32
    assert logp.item() == pytest.approx(-math.log(4))
    assert vocab_parallel_entropy(logits).item() == pytest.approx(math.log(4))
    assert vocab_parallel_full_kl(logits, logits).item() == pytest.approx(0.0, abs=1e-7)
    # the same through the algorithms entry point; padding column 3 dropped -> KL vs uniform-over-3 is 0
    kl = full_kl_penalty(torch.tensor([[0.0, 0.0, 0.0, 9.0]]), torch.zeros(1, 4), true_vocab_size=3)
    assert kl.item() == pytest.approx(0.0, abs=1e-7)


def _banned_reference(logits, ref_logits, targets, true_vocab_size, banned):
    """The definitions over the allowed vocabulary, as the engines sample: banned logits at -inf."""
    allowed = torch.ones(logits.shape[-1], dtype=torch.bool)
    allowed[list(banned)] = False
    allowed[true_vocab_size:] = False
    logp_all = logits.masked_fill(~allowed, -math.inf).log_softmax(-1)
    logq_all = ref_logits.masked_fill(~allowed, -math.inf).log_softmax(-1)
    p = logp_all.exp()
    safe = lambda t: t.masked_fill(~allowed, 0.0)  # noqa: E731  (0 * -inf is NaN; banned terms are 0)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(p * safe(logp_all)).sum(-1), (p * safe(logp_all - logq_all)).sum(-1)


def _banned_case(padded_vocab, true_vocab_size, banned, seed=0):
    """Data where the banned tokens hold most of the mass; targets are allowed tokens."""
    logits, ref_logits, _, weights = _data(padded_vocab, true_vocab_size, seed)
    logits[..., list(banned)] += 12.0
    ref_logits[..., list(banned)] += 10.0
    allowed = [t for t in range(true_vocab_size) if t not in banned]
    g = torch.Generator().manual_seed(seed + 1)
    targets = torch.tensor(allowed)[torch.randint(0, len(allowed), (2, 3), generator=g)]
    return logits, ref_logits, targets, weights


def _banned_values_and_grads(logits, ref_logits, targets, weights, true_vocab_size, banned, tp_group=None):
    logits = logits.clone().requires_grad_(True)
    ref_logits = ref_logits.clone().requires_grad_(True)
    kw = dict(tp_group=tp_group, true_vocab_size=true_vocab_size, banned_token_ids=banned)
    outs = (vocab_parallel_logprobs(logits, targets, **kw), vocab_parallel_entropy(logits, **kw),
            vocab_parallel_full_kl(logits, ref_logits, **kw))
    _weighted(*outs, weights).backward()
    return [o.detach() for o in outs], logits.grad, ref_logits.grad


def _banned_want(logits, ref_logits, targets, weights, true_vocab_size, banned):
    logits = logits.clone().requires_grad_(True)
    ref_logits = ref_logits.clone().requires_grad_(True)
    outs = _banned_reference(logits, ref_logits, targets, true_vocab_size, banned)
    _weighted(*outs, weights).backward()
    return [o.detach() for o in outs], logits.grad, ref_logits.grad


@pytest.mark.parametrize("padded_vocab, true_vocab_size", [(10, 10), (12, 10)])
def test_banned_tokens_leave_logprobs_entropy_and_kl(padded_vocab, true_vocab_size):
    """rollout.banned_token_ids is part of the policy: log-probs, entropy and KL over the allowed
    vocabulary (banned logits at -inf before the softmax), finite gradients, none into banned columns."""
    banned = (0, 4, 9)
    logits, ref_logits, targets, weights = _banned_case(padded_vocab, true_vocab_size, banned)
    banned_mass = logits[..., :true_vocab_size].softmax(-1)[..., list(banned)].sum(-1)
    assert banned_mass.mean() > 0.8  # the ban removes most of the mass: a full-vocabulary result is far off
    got, grad, ref_grad = _banned_values_and_grads(logits, ref_logits, targets, weights, true_vocab_size, banned)
    want, want_grad, want_ref_grad = _banned_want(logits, ref_logits, targets, weights, true_vocab_size, banned)
    for name, g, w in zip(("logprobs", "entropy", "full_kl"), got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=name)
    for g, w in ((grad, want_grad), (ref_grad, want_ref_grad)):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, torch.nan_to_num(w), rtol=0, atol=1e-12)
        assert torch.count_nonzero(g[..., list(banned)]) == 0
    full = vocab_parallel_logprobs(logits, targets, true_vocab_size=true_vocab_size)
    assert (got[0] - full).min() > 0.5  # log-probs of allowed tokens rise by -log(1 - banned mass)


def test_a_banned_target_is_hugely_negative_and_finite():
    # A masked slot may target a banned pad token (filler rows): finite, so 0 * it stays 0.
    logits = torch.zeros(1, 4)
    lp = vocab_parallel_logprobs(logits, torch.tensor([1]), banned_token_ids=(1,))
    assert torch.isfinite(lp).all() and lp.item() < -1e30
    assert vocab_parallel_entropy(logits, banned_token_ids=(1,)).item() == pytest.approx(math.log(3))
    assert vocab_parallel_full_kl(logits, logits, banned_token_ids=(1,)).item() == pytest.approx(0.0, abs=1e-7)
    kl = full_kl_penalty(torch.tensor([[0.0, 9.0, 0.0, 0.0]]), torch.zeros(1, 4), banned_token_ids=(1,))
    assert kl.item() == pytest.approx(0.0, abs=1e-7)  # the banned token's logit no longer matters


def _tp_worker(rank, port, world_size):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        padded_vocab = 12
        local = padded_vocab // world_size
        cols = slice(rank * local, (rank + 1) * local)
        # no padding; padding inside rank 1's slice; rank 1 holding padding columns only
        for true_vocab_size in (12, 11, 6):
            logits, ref_logits, targets, weights = _data(padded_vocab, true_vocab_size, seed=true_vocab_size)
            want, want_grad, want_ref_grad = _values_and_grads(
                logits, ref_logits, targets, weights, true_vocab_size, reference=True
            )
            want_grad = torch.nn.functional.pad(want_grad, (0, padded_vocab - true_vocab_size))
            want_ref_grad = torch.nn.functional.pad(want_ref_grad, (0, padded_vocab - true_vocab_size))
            got, grad, ref_grad = _values_and_grads(
                logits[..., cols], ref_logits[..., cols], targets, weights, true_vocab_size, tp_group=dist.group.WORLD
            )
            for name, g, w in zip(("logprobs", "entropy", "full_kl"), got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=f"{name}, true_vocab_size={true_vocab_size}")
            torch.testing.assert_close(grad, want_grad[..., cols], rtol=0, atol=1e-12)
            torch.testing.assert_close(ref_grad, want_ref_grad[..., cols], rtol=0, atol=1e-12)
        # banned tokens in both ranks' slices (and padding past 10): each rank masks its own columns
        for banned in ((0, 4, 9), (1,), (7, 8)):
            logits, ref_logits, targets, weights = _banned_case(padded_vocab, 10, banned, seed=len(banned))
            want, want_grad, want_ref_grad = _banned_want(logits, ref_logits, targets, weights, 10, banned)
            got, grad, ref_grad = _banned_values_and_grads(logits[..., cols], ref_logits[..., cols], targets, weights, 10,
                                                           banned, tp_group=dist.group.WORLD)
            for name, g, w in zip(("logprobs", "entropy", "full_kl"), got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=f"{name}, banned={banned}")
            torch.testing.assert_close(grad, torch.nan_to_num(want_grad)[..., cols], rtol=0, atol=1e-12)
            torch.testing.assert_close(ref_grad, torch.nan_to_num(want_ref_grad)[..., cols], rtol=0, atol=1e-12)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensor_parallel_two_processes_match_single_process():
    spawn(_tp_worker, 2, 2)
