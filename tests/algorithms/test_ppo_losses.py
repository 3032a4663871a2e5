"""Hand-worked values for agg_loss, policy_loss (incl. dual-clip), GSPO and value_loss, and the
global-batch test: the same gradient for every micro-batch / data-parallel split."""
import math

import pytest
import torch

from megarl.algorithms import AGG_MODES, agg_loss, gspo_policy_loss, policy_loss, value_loss

F64 = torch.float64


def t(rows, **kw):
    return torch.tensor(rows, dtype=F64, **kw)


# ---------------------------------------------------------------- agg_loss
LOSS_MAT = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])  # row 2 has no valid token


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 18 / 5),  # (1+2 + 4+5+6) / 5 tokens
        ("seq-mean-token-sum", 18 / 2),  # (3 + 15) / 2 non-empty sequences
        ("seq-mean-token-mean", (1.5 + 5.0) / 2),  # per-seq means 1.5 and 5
        ("seq-mean-token-sum-norm", 18 / (2 * 3)),  # / (2 seqs * response_len 3)
    ],
)
def test_agg_loss_single_batch(mode, expected):
    assert agg_loss(LOSS_MAT, AGG_MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_with_totals_and_scale_factor():
    # 18 / (2 seqs * 4) with an explicit Dr.GRPO constant
    assert agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm", loss_scale_factor=4).item() == pytest.approx(2.25)
    # the totals may cover more than this batch: 18 / 10 global tokens
    assert agg_loss(LOSS_MAT, AGG_MASK, "token-mean", global_tokens=10).item() == pytest.approx(1.8)
    per_seq_means = agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-mean", global_seqs=torch.tensor(4.0))
    assert per_seq_means.item() == pytest.approx(6.5 / 4)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_all_masked_gives_zero_not_nan(mode):
    loss_mat = t([[1.0, float("nan")], [float("inf"), 2.0]], requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(2, 2), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(loss_mat.grad, torch.zeros(2, 2, dtype=F64))


def test_agg_loss_errors():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        agg_loss(LOSS_MAT, AGG_MASK, "token-sum-mean")
    with pytest.raises(ValueError, match="global_tokens"):
        agg_loss(LOSS_MAT, AGG_MASK, "token-mean", global_seqs=3)
    with pytest.raises(ValueError, match="global_seqs"):
        agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-mean", global_tokens=3)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm", global_tokens=5, global_seqs=2)


# ---------------------------------------------------------------- policy_loss
# Six valid tokens (clip_ratio_low 0.2, clip_ratio_high 0.28, clip_ratio_c 3); column 3 is masked out.
#  tok  A   ratio  pg1=-A*r  pg2=-A*clip(r,0.8,1.28)  max    dual: min(-A*3, .)  final  clipped?  dual?
#  a   +1   1.5    -1.5      -1.28                     -1.28  (A>0)               -1.28  yes       no
#  b   +1   0.5    -0.5      -0.8                      -0.5   (A>0)               -0.5   no        no
#  c   -1   0.5     0.5       0.8                       0.8   min(3, 0.8)          0.8   yes       no
#  d   -1   5.0     5.0       1.28                      5.0   min(3, 5.0)          3.0   no        yes
#  e   -2   1.0     2.0       2.0                       2.0   min(6, 2.0)          2.0   no        no
#  f   +2   1.25   -2.5      -2.5 (1.25 < 1.28)        -2.5   (A>0)               -2.5   no        no
ADV = t([[1, 1, -1, 100], [-1, -2, 2, 100]])
RATIO = t([[1.5, 0.5, 0.5, 1.5], [5.0, 1.0, 1.25, 1.5]])
PG_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
OLD_LOGP = t([[-1.0, -2.0, -0.5, -1.0], [-3.0, -0.2, -1.0, -1.0]])


def test_policy_loss_clip_higher_and_dual_clip():
    logp = (OLD_LOGP + RATIO.log()).requires_grad_(True)
    loss, metrics = policy_loss(logp, OLD_LOGP, ADV, PG_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                clip_ratio_c=3.0)
    # (-1.28 - 0.5 + 0.8 + 3.0 + 2.0 - 2.5) / 6 = 1.52 / 6
    assert loss.item() == pytest.approx(1.52 / 6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 6)  # a, c
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 6)  # d
    # ppo_kl = mean(-log r) = -ln(1.5 * 0.5 * 0.5 * 5 * 1 * 1.25) / 6
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(2.34375) / 6)
    loss.backward()
    # Clipped tokens (a, c) and the dual-clipped token (d) are constants: zero gradient.
    # Unclipped: d(-A*r)/dlogp = -A*r: b -> -0.5, e -> 2, f -> -2.5; all / 6 tokens.
    torch.testing.assert_close(logp.grad, t([[0, -0.5, 0, 0], [0, 2.0, -2.5, 0]]) / 6)


def test_symmetric_clip_clips_token_f():
    logp = OLD_LOGP + RATIO.log()
    _, metrics = policy_loss(logp, OLD_LOGP, ADV, PG_MASK, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # with 1 + 0.2 = 1.2 < 1.25, token f is clipped as well: a, c, f
    assert metrics["actor/pg_clipfrac"] == pytest.approx(3 / 6)


def test_policy_loss_log_ratio_clamp():
    # log-ratio 30 is clamped to 20: ratio e^20, A = -1 -> dual-clip gives loss 3; ppo_kl = -20
    loss, metrics = policy_loss(t([[29.0]]), t([[-1.0]]), t([[-1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(3.0)
    assert metrics["actor/ppo_kl"] == pytest.approx(-20.0)
    assert metrics["actor/pg_clipfrac_lower"] == 1.0


@pytest.mark.parametrize("bad_c", [1.0, 0.5])
def test_policy_loss_rejects_clip_ratio_c_not_above_one(bad_c):
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(OLD_LOGP, OLD_LOGP, ADV, PG_MASK, clip_ratio_c=bad_c)


def test_policy_loss_all_masked_row_and_shape_errors():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    logp = (OLD_LOGP + RATIO.log()).requires_grad_(True)
    loss, _ = policy_loss(logp, OLD_LOGP, ADV, mask, clip_ratio_high=0.28, agg="seq-mean-token-mean")
    # only row 0: (-1.28 - 0.5 + 0.8) / 3 = -0.98 / 3, one sequence
    assert loss.item() == pytest.approx(-0.98 / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    with pytest.raises(ValueError, match="same shape"):
        policy_loss(OLD_LOGP, OLD_LOGP[:, :2], ADV, PG_MASK)


def test_gspo_sequence_ratio():
    # row 0: token log-ratios 0.1, 0.3 (third masked) -> s = e^0.2 = 1.2214 > 1.2: clipped, loss -1.2
    # row 1: log-ratios 0.0, 0.1 -> s = e^0.05 = 1.0513: not clipped, loss -1.0513 per token
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    logp = (old + t([[0.1, 0.3, 5.0], [0.0, 0.1, 5.0]])).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    advantages = torch.ones(2, 3, dtype=F64)
    loss, metrics = gspo_policy_loss(logp, old, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    s1 = math.exp(0.05)
    assert loss.item() == pytest.approx((-1.2 - s1) / 2)  # seq-mean-token-mean
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.1 + 0.3 + 0.0 + 0.1) / 4)
    loss.backward()
    # row 0 clipped: no gradient. row 1: d/dlogp_t of -s = -s (GSPO-token), / (2 tokens * 2 seqs)
    torch.testing.assert_close(logp.grad, t([[0, 0, 0], [-s1 / 4, -s1 / 4, 0]]))


# ---------------------------------------------------------------- value_loss
def test_value_loss():
    # tok  v     old   R     clip(v, old±0.5)  (v-R)^2  (vc-R)^2  max    clipped?
    #  1   1.0   0.0   2.0   0.5               1.0      2.25      2.25   yes
    #  2   1.0   0.8   0.0   1.0               1.0      1.0       1.0    no
    #  3  -1.0   0.0  -0.5  -0.5               0.25     0.0       0.25   no
    #  4   masked
    values = t([[1.0, 1.0, -1.0, 9.0]], requires_grad=True)
    old = t([[0.0, 0.8, 0.0, 0.0]])
    returns = t([[2.0, 0.0, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, clip_range=0.5)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.25) / 3)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # tok 1 uses the clipped (constant) branch; tok 2 and 3: 0.5 * 2 * (v - R) / 3
    torch.testing.assert_close(values.grad, t([[0.0, 1.0 / 3, -0.5 / 3, 0.0]]))


# ---------------------------------------------------------------- global-batch invariance
def _random_batch(batch=8, response_len=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 0, 4, 2, 5, 3, 6])  # includes an all-masked row and a one-token row
    mask = (torch.arange(response_len) < lengths.unsqueeze(-1)).to(F64)
    mask[0, 2] = 0  # a hole inside a multi-turn response
    mask[5, 1:3] = 0
    return {
        "logp": -torch.rand(batch, response_len, generator=g, dtype=F64) * 3,
        "old_logp": -torch.rand(batch, response_len, generator=g, dtype=F64) * 3,
        "advantages": torch.randn(batch, response_len, generator=g, dtype=F64),
        "values": torch.randn(batch, response_len, generator=g, dtype=F64),
        "old_values": torch.randn(batch, response_len, generator=g, dtype=F64),
        "returns": torch.randn(batch, response_len, generator=g, dtype=F64),
        "mask": mask,
    }


def _loss(kind, mb, agg, **totals):
    if kind == "policy":
        return policy_loss(mb["logp"], mb["old_logp"], mb["advantages"], mb["mask"], 0.2, 0.28, 3.0,
                           agg=agg, **totals)[0]
    if kind == "gspo":
        return gspo_policy_loss(mb["logp"], mb["old_logp"], mb["advantages"], mb["mask"], 0.1, 0.1,
                                agg=agg, **totals)[0]
    if kind == "value":
        return value_loss(mb["values"], mb["old_values"], mb["returns"], mb["mask"], 0.2, agg=agg, **totals)[0]
    return agg_loss(mb["logp"] * mb["advantages"], mb["mask"], agg, **totals)


@pytest.mark.parametrize("kind", ["agg", "policy", "gspo", "value"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradient_is_the_same_for_every_micro_batch_and_dp_split(kind, agg):
    batch = _random_batch()
    grad_key = "values" if kind == "value" else "logp"
    response_len = batch["mask"].shape[-1]

    # Reference: the whole global batch as one micro-batch on one rank, no totals.
    full = dict(batch, **{grad_key: batch[grad_key].clone().requires_grad_(True)})
    ref_loss = _loss(kind, full, agg)
    ref_loss.backward()
    ref_grad = full[grad_key].grad

    # Totals over the global batch, as the engine would all-reduce them once per step.
    totals = {
        "global_tokens": batch["mask"].sum(),
        "global_seqs": (batch["mask"].sum(-1) > 0).sum(),
        "loss_scale_factor": response_len,
    }
    for dp_size in (1, 2):
        for n_micro in (1, 2, 4):
            leaf = batch[grad_key].clone().requires_grad_(True)
            total_loss = 0.0
            # Rows are split over DP ranks, then over micro-batches; each micro-batch is trimmed to its
            # own longest response (dynamic padding), so response_len differs between micro-batches.
            for rank_rows in torch.arange(8).chunk(dp_size):
                for rows in rank_rows.chunk(n_micro):
                    keep = int(batch["mask"][rows].nonzero()[:, 1].max()) + 1 if batch["mask"][rows].any() else 1
                    mb = {k: v[rows, :keep] for k, v in batch.items()}
                    mb[grad_key] = leaf[rows, :keep]
                    # Summing contributions = SUM all-reduce of gradients over micro-batches and DP ranks.
                    total_loss = total_loss + _loss(kind, mb, agg, **totals)
            total_loss.backward()
            torch.testing.assert_close(total_loss, ref_loss.detach(), rtol=0, atol=1e-10)
            torch.testing.assert_close(leaf.grad, ref_grad, rtol=0, atol=1e-10)


def test_averaging_micro_batch_means_would_differ():
    # Why the totals matter: rows 0 and 1 hold 5 and 1 valid tokens. Averaging the two per-row
    # token-means (what verl's Megatron path does per micro-batch) weights the lone token of row 1
    # like the five of row 0, so it is not the token-mean of the 6 tokens.
    batch = _random_batch()
    loss_mat, mask = batch["logp"] * batch["advantages"], batch["mask"]
    averaged = (agg_loss(loss_mat[:1], mask[:1], "token-mean") + agg_loss(loss_mat[1:2], mask[1:2], "token-mean")) / 2
    pair = agg_loss(loss_mat[:2], mask[:2], "token-mean")
    assert abs(averaged.item() - pair.item()) > 1e-3


def test_loss_metrics_are_tensors_the_engine_reads_once_per_step():
    """No host synchronisation inside a loss: every metric is a 0-d tensor without grad (issue 28);
    the engine's float64 weighting of it is the arithmetic of the Python floats it replaced."""
    logp = t([[-1.0, -2.0, -0.5]], requires_grad=True)
    old, adv, mask = t([[-1.2, -1.0, -0.5]]), t([[1.0, -1.0, 0.5]]), t([[1, 1, 0]])
    results = [policy_loss(logp, old, adv, mask), gspo_policy_loss(logp, old, adv, mask),
               value_loss(logp, old, adv, mask, clip_range=0.2)]
    for _, metrics in results:
        assert metrics and all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    from megarl.engine.engine import _weighted

    clipfrac = torch.tensor(1 / 3, dtype=torch.float32)
    assert _weighted(clipfrac, 7.0).item() == clipfrac.item() * 7.0 and _weighted(0.25, 4.0) == 1.0
