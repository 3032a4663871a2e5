"""What the supervised-stage tests share: the tiny model and data, a config, and a trainer run without
megarl.run.Run (the in-process reference and the 2-rank layout worker both use it, so they compare
like with like)."""
from __future__ import annotations

from pathlib import Path

STEPS = 3  # "the same losses ... for 3 steps"
ROWS_PER_STEP = 8


def make_inputs(root: Path) -> dict[str, str]:
    """A tiny digits Llama (2 layers, untied: one per pipeline stage at pp2), SFT rows and preference pairs of the copy task."""
    from megarl.data.prepare import prepare_arithmetic_formats
    from megarl.tools.make_tiny_model import make_tiny_model

    model = root / "model"
    if not (model / "config.json").exists():
        make_tiny_model("llama", model, seed=0, tokenizer="digits", hidden=64, intermediate=128, layers=2, heads=4,
                        kv_heads=2, init_std=0.02)
    sft = prepare_arithmetic_formats(root / "sft", "sft", train_size=40, val_size=16)
    pairs = prepare_arithmetic_formats(root / "pairs", "preference", train_size=40, val_size=16)
    return {"model": str(model), "sft_train": str(sft["train"]), "sft_val": str(sft["test"]),
            "pairs_train": str(pairs["train"]), "pairs_val": str(pairs["test"])}


def make_moe_model(root: Path) -> str:
    """A tiny digits Mixtral: 4 layers (one per virtual stage at pp2 x vpp2), 4 experts of which each token uses 2."""
    from megarl.tools.make_tiny_model import make_tiny_model

    model = root / "moe_model"
    if not (model / "config.json").exists():
        make_tiny_model("mixtral", model, seed=1, tokenizer="digits", hidden=64, intermediate=64, layers=4, heads=4,
                        kv_heads=2, experts=4, topk=2, init_std=0.02)
    return str(model)


def role(stage: str) -> str:
    """The engine role a stage trains: SFT the policy (actor), the reward model a scalar-head model (critic)."""
    return "actor" if stage == "sft" else "critic"


# The model variants the layout tests run besides the dense model: overrides of `config`, given the inputs.
VARIANTS = {
    "dense": lambda inputs, stage: [],
    "moe": lambda inputs, stage: [f"model.path={inputs['moe_model']}"],
    "lora": lambda inputs, stage: [f"{role(stage)}.lora.rank=4", f"{role(stage)}.lora.alpha=8"],
}


def config(inputs: dict[str, str], stage: str, run_dir: str, *overrides: str):
    """The stage's config: packed micro-batches with a small token budget (several micro-batches per step)."""
    from megarl.config import load_config

    data = ("sft_train", "sft_val") if stage == "sft" else ("pairs_train", "pairs_val")
    role_ = role(stage)
    return load_config(None, [
        f"model.path={inputs['model']}", "model.dtype=float32", "model.sequence_packing=true",
        f"data.train_files=[{inputs[data[0]]}]", f"data.val_files=[{inputs[data[1]]}]",
        f"supervised.rows_per_step={ROWS_PER_STEP}", "supervised.max_length=16",
        f"{role_}.optim.lr=1e-2", f"{role_}.optim.weight_decay=0.0", f"{role_}.max_tokens_per_microbatch=32",
        f"trainer.run_dir={run_dir}", f"trainer.total_steps={STEPS}", "trainer.val_every_steps=1",
        "trainer.save_every_steps=2", "trainer.seed=3", *overrides])


class Metrics:
    """A tracker that keeps each step's metrics (the trainer calls log / event / samples)."""

    def __init__(self):
        self.steps: dict[int, dict] = {}

    def log(self, metrics, step):
        self.steps[step] = dict(metrics)

    def event(self, *args, **kwargs):
        pass


class NoSignal:
    keep_until_exit = False

    def agreed(self):
        return None


def train(cfg, dims, stage: str, resume_from: str | None = None) -> dict[int, dict]:
    """Run the stage's trainer to trainer.total_steps (from a checkpoint when given); its metrics by step."""
    from megarl.supervised.trainer import SupervisedTrainer

    trainer = SupervisedTrainer(cfg, dims, stage, log=lambda _: None)
    if resume_from is not None:
        trainer.resume(Path(resume_from))
    metrics = Metrics()
    trainer.train(metrics, NoSignal())
    return metrics.steps


COMPARED = {"sft": ("sft/loss", "sft/grad_norm", "val/sft/loss"),
            "reward_model": ("rm/loss", "rm/accuracy", "rm/margin", "rm/grad_norm", "val/rm/loss", "val/rm/accuracy")}
