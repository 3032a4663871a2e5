"""ReMax against an engine that sleeps like vLLM and SGLang do (issue 22 item 4, audit F3).

After `release_memory()` vLLM (sleep level 2) and SGLang (release without CPU backup) have dropped
the weights: only `load_weights()` brings them back, `resume_memory()` alone raises (vLLM's
wake_up(["kv_cache"]) reports "not fully awake"; SGLang still lists "weights" as released) and so
does `generate`. The HF engine never sleeps, so a ReMax step that generated its greedy baseline
after release_memory() passed on CPU and crashed on the first GPU run.
"""
from __future__ import annotations

from megarl.config import load_config, validate


class FakeSleepingEngine:
    """A fake of vLLM's / SGLang's sleep contract around a real engine (the HF one generates).

    release_memory(): weights and KV cache gone (vLLM sleep(level=2); SGLang
    release_memory_occupation() without enable_weights_cpu_backup). resume_memory() without a
    load_weights() since then raises, as vllm.py/sglang.py do; generate() while asleep raises."""

    def __init__(self, inner):
        self.inner = inner
        self.weights_valid = self.kv_awake = False  # the real adapters put the engine to sleep at start
        self.calls: list[str] = []

    def load_weights(self, weights):
        self.calls.append("load_weights")
        self.inner.load_weights(weights)
        self.weights_valid = True

    def resume_memory(self):
        self.calls.append("resume_memory")
        if not self.weights_valid:
            raise RuntimeError("fake vLLM: not fully awake after wake_up(tags=['kv_cache']); call load_weights() first")
        self.kv_awake = True

    def release_memory(self):
        self.calls.append("release_memory")
        self.weights_valid = self.kv_awake = False

    def generate(self, requests, sampling):
        self.calls.append("generate")
        if not (self.weights_valid and self.kv_awake):
            raise RuntimeError("fake vLLM: generate on a sleeping engine (weights released)")
        return self.inner.generate(requests, sampling)

    def __getattr__(self, name):  # record_routes, close, ...
        return getattr(self.inner, name)


def test_remax_step_generates_its_greedy_baseline_while_the_engine_is_awake(tmp_path, world_of_one):
    from megarl.data.prepare import prepare_if_missing
    from megarl.tools.make_tiny_model import make_tiny_model
    from megarl.trainer import Trainer

    cfg = load_config("configs/tiny_cpu.yaml", [
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'test.parquet'}]", "data.arithmetic.train_size=64", "data.arithmetic.val_size=8",
        "data.prompts_per_step=4", "rollout.samples_per_prompt=2", "actor.ppo_epochs=1", "actor.ppo_mini_batches=1",
        "algorithm.adv_estimator=remax", f"trainer.run_dir={tmp_path / 'run'}", "tracking.mlflow=false"])
    validate(cfg, 1)
    make_tiny_model("llama", cfg.model.path, seed=0, tokenizer="digits", hidden=32, intermediate=64, layers=1, heads=2,
                    kv_heads=1, max_positions=64)
    prepare_if_missing(cfg.data)
    trainer = Trainer(cfg, world_of_one, log=lambda _: None)
    trainer.rollout.engine = engine = FakeSleepingEngine(trainer.rollout.engine)  # the side drives this engine
    trainer.step = 1
    trainer.ppo_step()
    # sync, then both generations (sampled, greedy) before the engine sleeps; nothing after
    assert engine.calls == ["load_weights", "resume_memory", "generate", "generate", "release_memory"]
