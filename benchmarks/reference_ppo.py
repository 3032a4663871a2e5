"""python benchmarks/reference_ppo.py [--config configs/tiny_cpu.yaml] [--steps N] [--seed S] [--eval-every K] [--out FILE.json]

An independent, textbook PPO with a critic (Schulman et al. 2017, https://arxiv.org/abs/1707.06347;
GAE, Schulman et al. 2016, https://arxiv.org/abs/1506.02438) in plain PyTorch + transformers, on
the CPU demo's task, model, batch and steps, so that megarl's learning per sample has a yardstick
(benchmarks/learning.py runs the two side by side).

No megarl training code is used: no engine, trainer, loss or advantage function. megarl supplies
only what defines the task: the run config (read for its numbers: batch geometry, learning rates,
epochs, clip ranges), the tiny model and the data files (created as the demo creates them), the
reward (megarl.rewards.arithmetic_score of megarl.rewards.decode.response_text), and the ruler
(megarl.tools.eval_exact_match.exact_match on a saved copy of the policy), so both trainers are
measured the same way.

Textbook choices, each the common one: sampling and log-probs over the allowed vocabulary (the
run's rollout.banned_token_ids masked to -inf, so the policy trained is the one sampled); the score
on the last response token; GAE with the run's gamma / lam; advantages whitened over the batch's
response tokens; clipped surrogate (no dual clip) and clipped value loss (0.5 * max of squared
errors), both token means over each mini-batch; separate Adam optimizers with the run's learning
rates and cosine schedules, gradient norms clipped to max_grad_norm; critic = the policy's trunk
plus a linear value head with bias 0 and weight ~ N(0, 0.01^2/hidden) (--head-init small: initial values
of about 0.01 on the final norm's unit-RMS hidden states) or N(0, 1/(hidden+1)) (--head-init trl, TRL's
scale: initial values of about 1, as large as the rewards).

Prints one JSON line per evaluation; --out writes {"trainer", "config", "seed", "points": [{"step",
"samples", "exact_match", "score"}]}, where score is the mean reward of that step's rollout.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Critic(torch.nn.Module):
    """The policy's transformer trunk with a scalar head: values [b, s]."""

    def __init__(self, model_dir: str, generator: torch.Generator, head_init: str = "small"):
        super().__init__()
        from transformers import AutoModel

        self.trunk = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
        hidden = self.trunk.config.hidden_size
        self.head = torch.nn.Linear(hidden, 1)
        with torch.no_grad():
            std = 0.01 / math.sqrt(hidden) if head_init == "small" else 1 / math.sqrt(hidden + 1)
            self.head.weight.copy_(torch.randn(1, hidden, generator=generator) * std)
            self.head.bias.zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(input_ids=input_ids).last_hidden_state).squeeze(-1)


def allowed_log_probs(logits: torch.Tensor, banned: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-softmax over the allowed vocabulary (banned tokens get -inf)."""
    logits = logits / temperature
    if banned:
        logits = logits.clone()
        logits[..., banned] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


@torch.no_grad()
def sample(policy, prompts: torch.Tensor, n_new: int, eos: int, pad: int, banned: list[int], temperature: float,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses [b, n_new] (pad after eos) and their mask [b, n_new] (1 up to and including eos)."""
    tokens, done = prompts, torch.zeros(len(prompts), dtype=torch.bool)
    responses, mask = [], []
    for _ in range(n_new):
        logp = allowed_log_probs(policy(input_ids=tokens).logits[:, -1], banned, temperature)
        token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        token = torch.where(done, torch.full_like(token, pad), token)
        mask.append((~done).float())
        responses.append(token)
        done = done | (token == eos)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
    return torch.stack(responses, 1), torch.stack(mask, 1)


def token_log_probs(policy, input_ids: torch.Tensor, prompt_len: int, mask: torch.Tensor, banned: list[int],
                    temperature: float) -> torch.Tensor:
    """[b, R] log-probs of the response tokens (position t predicts token t + 1), 0 where mask is 0
    (the padding after eos may be a banned token, whose log-prob is -inf)."""
    logits = policy(input_ids=input_ids).logits[:, prompt_len - 1 : -1]
    logp = allowed_log_probs(logits, banned, temperature)
    taken = logp.gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)
    return torch.where(mask.bool(), taken, torch.zeros_like(taken))


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """(advantages, returns) [b, R]; responses are right-padded, so the recursion stops at the mask."""
    advantages = torch.zeros_like(rewards)
    last, next_value = torch.zeros(len(rewards)), torch.zeros(len(rewards))
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        next_value = values[:, t] * mask[:, t]
        advantages[:, t] = last
    return advantages, advantages + values


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = (x * mask).sum() / mask.sum()
    var = (((x - mean) * mask) ** 2).sum() / (mask.sum() - 1)
    return (x - mean) / torch.sqrt(var + 1e-8) * mask


def cosine(optimizer, total: int, lr: float, min_lr: float):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: (min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(i, total) / total))) / lr)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def evaluate(policy, tokenizer, model_dir: str, val_files: list[str], banned: list[int]) -> float:
    """Greedy exact match of the current policy with megarl's ruler (on a saved copy)."""
    from megarl.tools.eval_exact_match import exact_match

    with tempfile.TemporaryDirectory() as tmp:
        policy.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (Path(model_dir) / name).exists():
                shutil.copy(Path(model_dir) / name, tmp)
        return exact_match(tmp, val_files, banned_token_ids=tuple(banned))["exact_match"]


def train(config: str, overrides: list[str], steps: int | None, seed: int, eval_every: int, head_init: str = "small",
          log=print) -> dict:
    from transformers import AutoModelForCausalLM

    from megarl.config import load_config
    from megarl.data.dataset import encode_prompt, read_prompt_files
    from megarl.data.prepare import prepare_if_missing
    from megarl.data.tokenizer import load_tokenizer
    from megarl.rewards import arithmetic_score
    from megarl.rewards.decode import response_text
    from megarl.tools.make_tiny_model import make_tiny_model

    cfg = load_config(config, list(overrides))
    steps = steps or cfg.trainer.total_steps
    model_dir = cfg.model.path
    if cfg.model.make_tiny.enable and not Path(model_dir).is_dir():  # as launch/ppo.py creates it
        options = asdict(cfg.model.make_tiny)
        options.pop("enable")
        make_tiny_model(options.pop("arch"), model_dir, seed=options.pop("seed"), **options)
    prepare_if_missing(cfg.data, ())
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    tokenizer = load_tokenizer(model_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    banned = list(cfg.rollout.banned_token_ids)
    r, a, c, alg = cfg.rollout, cfg.actor, cfg.critic, cfg.algorithm

    rows = read_prompt_files(cfg.data.train_files)
    encoded = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    if len({len(e) for e in encoded}) != 1:
        raise SystemExit("reference_ppo: the prompts must all have one length (the copy task's); this data mixes lengths")
    prompt_len = len(encoded[0])
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    critic = Critic(model_dir, torch.Generator().manual_seed(0), head_init)
    updates = steps * a.ppo_epochs * a.ppo_mini_batches
    opt_pi = torch.optim.Adam(policy.parameters(), lr=a.optim.lr, betas=tuple(a.optim.betas), eps=a.optim.eps)
    opt_v = torch.optim.Adam(critic.parameters(), lr=c.optim.lr, betas=tuple(c.optim.betas), eps=c.optim.eps)
    sched_pi = cosine(opt_pi, updates, a.optim.lr, a.optim.min_lr if a.optim.schedule == "cosine" else a.optim.lr)
    sched_v = cosine(opt_v, steps * c.ppo_epochs * c.ppo_mini_batches, c.optim.lr,
                     c.optim.min_lr if c.optim.schedule == "cosine" else c.optim.lr)

    order = torch.randperm(len(rows), generator=gen)
    m, n = cfg.data.prompts_per_step, r.samples_per_prompt
    points, started = [], time.perf_counter()
    em = evaluate(policy, tokenizer, model_dir, cfg.data.val_files, banned)
    points.append({"step": 0, "samples": 0, "exact_match": em, "score": None})
    log(json.dumps({"trainer": "reference_ppo", **points[-1]}))
    for step in range(1, steps + 1):
        idx = order[(step - 1) * m : step * m].tolist()
        prompts = torch.tensor([encoded[i] for i in idx]).repeat_interleave(n, dim=0)
        truths = [rows[i]["ground_truth"] for i in idx for _ in range(n)]
        policy.eval()
        responses, mask = sample(policy, prompts, r.max_new_tokens, eos, pad, banned, r.temperature, gen)
        seqs = torch.cat([prompts, responses], dim=1)
        scores = torch.tensor([arithmetic_score(response_text(tokenizer, resp[: int(k.sum())].tolist(), (eos,)), t)
                               for resp, k, t in zip(responses, mask, truths)])
        with torch.no_grad():
            old_logp = token_log_probs(policy, seqs, prompt_len, mask, banned, r.temperature)
            old_values = critic(seqs)[:, prompt_len - 1 : -1] * mask
        rewards = torch.zeros_like(mask)
        rewards[torch.arange(len(scores)), mask.sum(1).long() - 1] = scores
        advantages, returns = gae(rewards, old_values, mask, alg.gamma, alg.lam)
        advantages = whiten(advantages, mask)

        policy.train()
        for role, epochs, minis in (("critic", c.ppo_epochs, c.ppo_mini_batches), ("actor", a.ppo_epochs, a.ppo_mini_batches)):
            for _ in range(epochs):
                for mb in torch.randperm(len(seqs), generator=gen).chunk(minis):
                    k = mask[mb]
                    if role == "critic":
                        v = critic(seqs[mb])[:, prompt_len - 1 : -1]
                        v_clip = old_values[mb] + (v - old_values[mb]).clamp(-c.vf_clip, c.vf_clip)
                        loss = 0.5 * masked_mean(torch.maximum((v - returns[mb]) ** 2, (v_clip - returns[mb]) ** 2), k)
                        opt, sched, params, clip = opt_v, sched_v, critic.parameters(), c.optim.max_grad_norm
                    else:
                        ratio = torch.exp(token_log_probs(policy, seqs[mb], prompt_len, k, banned, r.temperature) - old_logp[mb])
                        adv = advantages[mb]
                        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - a.clip_ratio, 1 + a.clip_ratio) * adv)
                        loss = -masked_mean(surrogate, k)
                        opt, sched, params, clip = opt_pi, sched_pi, policy.parameters(), a.optim.max_grad_norm
                    opt.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(params, clip)
                    opt.step()
                    sched.step()
        score = float(scores.mean())
        if step % eval_every == 0 or step == steps:
            policy.eval()
            em = evaluate(policy, tokenizer, model_dir, cfg.data.val_files, banned)
            points.append({"step": step, "samples": step * m * n, "exact_match": em, "score": score})
            log(json.dumps({"trainer": "reference_ppo", **points[-1], "elapsed_s": round(time.perf_counter() - started, 1)}))
    return {"trainer": "reference_ppo", "config": config, "overrides": list(overrides), "seed": seed, "steps": steps,
            "head_init": head_init,
            "points": points}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="textbook PPO with a critic on the CPU demo's task (the yardstick of benchmarks/learning.py)")
    p.add_argument("--config", default="configs/tiny_cpu.yaml", help="the megarl run config whose task and numbers to use")
    p.add_argument("--steps", type=int, default=None, help="PPO steps (default: the config's trainer.total_steps)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=10, help="measure greedy exact match every K steps (and at the end)")
    p.add_argument("--head-init", choices=("small", "trl"), default="small", help="the value head's initial scale (see above)")
    p.add_argument("--out", help="write the curve as JSON here")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, as launch/ppo.py takes them")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    result = train(args.config, args.overrides, args.steps, args.seed, args.eval_every, args.head_init)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
