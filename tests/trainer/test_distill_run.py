"""On-policy distillation in the trainer (algorithm.distill, issue 39 item 3), in one process on the
shipped configs/tiny_cpu_distill.yaml: the teacher (larger than the student, the same tokenizer)
scores the student's own samples as transformers does; the step's reverse KL is the policy tokens'
only, environment tokens of multi-turn episodes left out; and a short run distils: the reverse KL to
a fixed teacher falls and the student's greedy answers move to the teacher's."""
from __future__ import annotations

import pytest
import torch

from megarl.agents import Environment
from megarl.config import load_config, validate

BANNED = (0, 1, 3)  # the config's rollout.banned_token_ids


class EchoKey(Environment):
    """A two-turn episode: after the policy's first turn the environment says "=<key>" (mask 0)."""

    def reset(self, row):
        self.key = row["prompt"].rstrip("=")

    def step(self, turn):
        return "=" + self.key, 0.0, turn.index >= 1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The demo's data, a student (1 layer, hidden 32) and a random teacher twice its size."""
    from megarl.data.prepare import prepare_arithmetic
    from megarl.tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("distill")
    prepare_arithmetic(root / "data", "copy", 3, 256, 16)
    common = dict(tokenizer="digits", heads=4, kv_heads=2, max_positions=64)
    make_tiny_model("llama", root / "student", seed=0, hidden=32, intermediate=64, layers=1, **common)
    make_tiny_model("llama", root / "teacher", seed=5, hidden=64, intermediate=128, layers=2, init_std=0.3, **common)
    return root


def distill_trainer(root, run: str, world, **overrides):
    """A Trainer of configs/tiny_cpu_distill.yaml on `root`'s models, shrunk to a cheap step."""
    from megarl.trainer import Trainer

    base = {"model.path": root / "student", "model.make_tiny.enable": "false",
            "algorithm.distill.teacher_path": root / "teacher", "data.train_files": f"[{root / 'data/train.parquet'}]",
            "data.val_files": "[]", "data.prompts_per_step": 4, "rollout.samples_per_prompt": 2, "actor.ppo_epochs": 1,
            "actor.ppo_mini_batches": 1, "trainer.run_dir": root / run, "tracking.loggers": "[jsonl]"}
    cfg = load_config("configs/tiny_cpu_distill.yaml", [f"{k}={v}" for k, v in {**base, **overrides}.items()])
    validate(cfg, 1)
    return Trainer(cfg, world, log=lambda _: None)


def capture_teacher(trainer) -> list:
    """Records each (batch, teacher log-probs) the trainer's Distillation scores."""
    seen, score = [], trainer.distill.score

    def recording(batch, temperature, banned):
        out = score(batch, temperature, banned)
        seen.append((batch, out))
        return out

    trainer.distill.score = recording
    return seen


def hf_logprobs(model_dir, batch, temperature: float) -> torch.Tensor:
    """[n, R] transformers' log-probs of each response token (logits / temperature, the banned tokens
    removed), one sequence at a time: no padding, no packing."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = torch.zeros(len(batch), batch.response_len)
    with torch.no_grad():
        for i, seq in enumerate(batch.input_ids):
            ids = torch.tensor([seq])
            logits = hf(ids).logits[0, :-1].float() / temperature
            logits[:, list(BANNED)] = -torch.inf
            logp = torch.log_softmax(logits, -1)
            p = batch.prompt_lens[i]
            r = len(seq) - p
            out[i, :r] = logp[p - 1:].gather(-1, ids[0, p:, None])[:, 0]
    return out * batch.response_mask


def test_teacher_scores_the_students_samples_as_transformers_does(models, world_of_one):
    trainer = distill_trainer(models, "parity", world_of_one, **{"rollout.temperature": 0.7})
    assert trainer.distill.teacher.spec.num_layers == 2 > trainer.actor.spec.num_layers  # a larger teacher
    seen = capture_teacher(trainer)
    trainer.step = 1
    metrics, _ = trainer.ppo_step()
    ((batch, teacher_logp),) = seen
    mask = batch.response_mask
    expected_teacher = hf_logprobs(models / "teacher", batch, 0.7)
    torch.testing.assert_close(teacher_logp, expected_teacher, rtol=0, atol=2e-5)
    # the step's reverse KL: the student's log-probs before its update (transformers') minus the teacher's
    student_logp = hf_logprobs(models / "student", batch, 0.7)
    expected_rkl = ((student_logp - expected_teacher) * mask).sum() / mask.sum()
    assert metrics["distill/reverse_kl"] == pytest.approx(expected_rkl.item(), abs=1e-4)
    assert metrics["distill/teacher_logp_mean"] == pytest.approx(((expected_teacher * mask).sum() / mask.sum()).item(), abs=1e-4)
    assert metrics["critic/score/mean"] == 0.0  # reward.kind=none: the teacher alone teaches
    # reward mode: every token's reward is coef * (teacher - student), so the sum of rewards is -rkl summed
    assert metrics["critic/rewards/mean"] == pytest.approx(-(expected_rkl * mask.sum() / len(batch)).item(), rel=1e-4)


def test_environment_tokens_are_neither_scored_nor_trained(models, world_of_one):
    trainer = distill_trainer(models, "multi_turn", world_of_one, **{
        "rollout.multi_turn.environment": "test_distill_run:EchoKey", "rollout.multi_turn.max_turns": 2,
        "rollout.multi_turn.max_tokens_per_turn": 3, "rollout.max_new_tokens": 12, "rollout.stop_token_ids": "[]",
        "algorithm.distill.mode": "loss"})
    seen = capture_teacher(trainer)
    losses = []
    loss = trainer.distill.loss
    trainer.distill.loss = lambda logp, teacher, mask, *a, **kw: losses.append((teacher, mask)) or loss(logp, teacher, mask, *a, **kw)
    trainer.step = 1
    metrics, _ = trainer.ppo_step()
    ((batch, teacher_logp),) = seen
    mask = batch.response_mask
    lengths = torch.tensor([len(s) - p for s, p in zip(batch.input_ids, batch.prompt_lens)])
    holes = (mask == 0) & (torch.arange(batch.response_len) < lengths[:, None])
    assert holes.sum() >= len(batch) * 4  # every episode: "=" and the three digits of the key, mask 0
    assert metrics["agents/env_token_fraction"] > 0.3
    assert (teacher_logp[holes] == 0).all()
    # the metric averages over the policy's tokens only: transformers' numbers with the holes left out
    teacher_all, student_all = (hf_logprobs(models / name, batch, 1.0) for name in ("teacher", "student"))
    inside = torch.arange(batch.response_len) < lengths[:, None]
    rkl = student_all - teacher_all
    assert metrics["distill/reverse_kl"] == pytest.approx(((rkl * mask).sum() / mask.sum()).item(), abs=1e-4)
    with_holes = (hf_logprobs_unmasked(models, batch) * inside).sum() / inside.sum()
    assert abs(with_holes.item() - metrics["distill/reverse_kl"]) > 0.05  # the holes would have shown
    # mode=loss: the actor's loss read the teacher under the loss mask, zero over the holes
    assert losses and all(((t != 0) <= (m != 0)).all() for t, m in losses)
    assert torch.isfinite(torch.tensor(metrics["actor/distill_loss"]))
    assert metrics["critic/rewards/mean"] == 0.0  # the loss mode leaves the rewards alone


def hf_logprobs_unmasked(root, batch) -> torch.Tensor:
    """student - teacher log-ratio on every response token, environment tokens included."""
    from dataclasses import replace

    lengths = torch.tensor([len(s) - p for s, p in zip(batch.input_ids, batch.prompt_lens)])
    every = (torch.arange(batch.response_len) < lengths[:, None]).float()
    full = replace(batch, tensors={**batch.tensors, "response_mask": every})
    return hf_logprobs(root / "student", full, 1.0) - hf_logprobs(root / "teacher", full, 1.0)


def test_student_distils_a_teacher_that_solves_the_task(models, world_of_one, tmp_path):
    """No task reward: 50 steps of 16 prompts x 4 samples from the shipped config (lr raised for the
    small batch) take the 1-layer student from greedy exact match 0 to the teacher's on held-out
    prompts, while the reverse KL of its samples to the teacher falls from ~4 nats per token to ~0."""
    from distill_helpers import supervised_copy_teacher

    from megarl.tools.eval_exact_match import exact_match

    teacher = supervised_copy_teacher(models / "copy_teacher", hidden=32, layers=2, steps=150)
    held_out = [str(models / "data/test.parquet")]
    match = lambda model_dir: exact_match(str(model_dir), held_out, banned_token_ids=BANNED)["exact_match"]  # noqa: E731
    trainer = distill_trainer(models, "learn", world_of_one, **{
        "algorithm.distill.teacher_path": teacher, "data.prompts_per_step": 16, "rollout.samples_per_prompt": 4,
        "actor.ppo_epochs": 2, "actor.ppo_mini_batches": 2, "actor.optim.lr": 3e-3, "actor.optim.min_lr": 3e-4,
        "trainer.total_steps": 50})
    reverse_kl = []
    for step in range(1, 51):
        trainer.step = step
        metrics, _ = trainer.ppo_step()
        reverse_kl.append(metrics["distill/reverse_kl"])
    trainer.actor.save_hf_checkpoint(tmp_path / "student", str(models / "student"), banned_token_ids=BANNED)
    teacher_match, before, after = match(teacher), match(models / "student"), match(tmp_path / "student")
    assert teacher_match >= 0.9 and before == 0.0
    assert after >= 0.9 * teacher_match, (after, teacher_match, reverse_kl)
    assert reverse_kl[0] > 3.0 and max(reverse_kl[-5:]) < 0.1 * reverse_kl[0], reverse_kl
