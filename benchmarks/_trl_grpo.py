"""TRL's GRPOTrainer on the CPU demo's work, for benchmarks/vs_trl.py (run in TRL's own venv).

    runs/trl-venv/bin/python benchmarks/_trl_grpo.py --model DIR --train FILE.parquet --steps N --out FILE.json

The same model, prompts and batch geometry as configs/tiny_cpu.yaml: 32 prompts x 16 samples per
generation, 4 epochs (num_iterations) x 4 mini-batches of 128 (steps_per_generation), one optimizer
step per mini-batch, so one PPO step is 16 of TRL's optimizer steps; the same clip (0.2), loss
aggregation (token-mean over the mini-batch: TRL's "dapo"), group-normalised advantages, learning
rate and cosine schedule to the same floor, gradient clipping, no KL (beta 0), 4 new tokens at
temperature 1 with the demo's banned tokens. Writes the wall and CPU seconds of each PPO step
(16 optimizer steps, its generation included).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def arithmetic_score():
    """megarl's reward function, loaded from its file (this venv does not install megarl)."""
    spec = importlib.util.spec_from_file_location("arithmetic", REPO / "megarl" / "rewards" / "arithmetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.arithmetic_score


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--steps", type=int, default=6, help="PPO steps (x 16 optimizer steps)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=5e-5)
    p.add_argument("--total-steps", type=int, default=80, help="the demo's PPO steps, for the cosine schedule")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    score = arithmetic_score()
    prompts, samples, epochs, mini_batches = 32, 16, 4, 4
    optimizer_steps = epochs * mini_batches
    data = load_dataset("parquet", data_files=args.train, split="train").select_columns(["prompt", "ground_truth"])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    def reward(completions, ground_truth, **kwargs):
        return [score(c, g) for c, g in zip(completions, ground_truth)]

    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_out"), use_cpu=True, bf16=False, seed=args.seed, report_to="none",
        save_strategy="no", logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0,
        per_device_train_batch_size=prompts * samples // mini_batches, gradient_accumulation_steps=1,
        num_generations=samples, steps_per_generation=mini_batches,  # 4 x 128 = 32 prompts x 16 per generation
        num_iterations=epochs, max_steps=args.steps * optimizer_steps, max_completion_length=4, temperature=1.0,
        top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=args.lr, weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": args.min_lr}, warmup_steps=0,
        generation_kwargs={"bad_words_ids": [[0], [1], [3]]},  # rollout.banned_token_ids of the demo
    )
    # The cosine runs over the demo's 80 PPO steps (as in megarl's run), not over the few timed here.
    config.max_steps = args.total_steps * optimizer_steps
    marks: list[tuple[float, float]] = []
    stop_after = args.steps * optimizer_steps

    class Clock(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            marks.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, a, state, control, **kw):
            if state.global_step % optimizer_steps == 0:
                marks.append((time.perf_counter(), time.process_time()))
            if state.global_step >= stop_after:
                control.should_training_stop = True

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer,
                          callbacks=[Clock()])
    trainer.train()
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    Path(args.out).write_text(json.dumps({"step_wall_s": wall, "step_cpu_s": cpu, "optimizer_steps_per_step": optimizer_steps,
                                          "trl": __import__("trl").__version__, "torch_threads": torch.get_num_threads()}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
