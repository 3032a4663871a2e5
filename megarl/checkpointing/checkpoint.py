"""Save / resume of a whole PPO run, and HF export of a checkpoint.

A checkpoint is `<run_dir>/checkpoints/step_XXXXXXXX/` holding `actor/` and `critic/` (Megatron
distributed checkpoints: weights + optimizer, reshardable to any layout; under `<role>.lora` the
adapters + their optimizer state and `base_ref.json`, the base's path and hash) and `trainer.pt`
(`Trainer.state_dict()`: step, KL controller, data position, guard state). It is written into a temporary directory
and renamed into place with a COMPLETE marker (`megarl.checkpointing.checkpoint_io.atomic_dir`), so a run killed
while saving resumes from the previous complete checkpoint.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from megarl import hub
from megarl.checkpointing.checkpoint_io import atomic_dir, cleanup_old_checkpoints, latest_complete_checkpoint, step_dir
from megarl.platform.safe_load import load_plain
from megarl.engine.engine import EngineConfig, MegatronEngine
from megarl.models import base_ref
from megarl.models.lora import LoraOptions
from megarl.distributed.parallel import dims_from_env


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    return latest_complete_checkpoint(checkpoints_root(run_dir))


def save(trainer, run_dir: str | Path, step: int, keep_last: int = 0) -> Path:
    """Collective: every rank writes its engines' shards; rank 0 writes `trainer.state_dict()` and the
    marker, then (keep_last > 0) deletes all but the newest keep_last complete checkpoints.

    `trainer` is anything with `checkpointed_engines()` ({role: engine with save/load}) and
    `state_dict()` / `load_state_dict()` (megarl.trainer.Trainer).
    """
    root = checkpoints_root(run_dir)
    final = step_dir(root, step)
    with atomic_dir(final, rank=dist.get_rank(), barrier=dist.barrier, token=f"step{step}") as tmp:
        for role, engine in trainer.checkpointed_engines().items():
            engine.save(str(tmp / role))
        if dist.get_rank() == 0:
            torch.save(trainer.state_dict(), tmp / "trainer.pt")
    if dist.get_rank() == 0 and keep_last:
        cleanup_old_checkpoints(root, keep_last)
    return final


def restore(trainer, path: str | Path, weights_only: bool = False) -> int:
    """Load the engines (and unless weights_only, `trainer.load_state_dict`); returns the checkpoint's step."""
    path = Path(path)
    if not (path / "trainer.pt").is_file():
        raise FileNotFoundError(f"{path} is not a megarl checkpoint (no trainer.pt)")
    engines = trainer.checkpointed_engines()
    if "critic" in engines and not (path / "critic").is_dir():
        raise FileNotFoundError(f"{path} has no critic checkpoint, but algorithm.adv_estimator=gae needs one")
    for role, engine in engines.items():
        engine.load(str(path / role))
    state = load_plain(path / "trainer.pt")
    if not weights_only:
        trainer.load_state_dict(state)
    return state["step"]


# --- python -m megarl.checkpointing.checkpoint --ckpt DIR --out DIR (alias: megarl.tools.export_hf) ---


def export_hf_main(argv=None) -> int:
    """Write a checkpoint's actor (or critic) as a Hugging Face model directory that transformers loads."""
    p = argparse.ArgumentParser(description="export a megarl checkpoint to a Hugging Face model directory")
    p.add_argument("--ckpt", required=True, help="a checkpoint directory (run_dir/checkpoints/step_XXXXXXXX)")
    p.add_argument("--out", required=True)
    p.add_argument("--role", choices=("actor", "critic"), default=None,
                   help="default: actor, or critic for a checkpoint that holds only a critic (a reward model's, launch/reward_model.py); "
                        "a critic is written as a transformers *ForSequenceClassification (num_labels 1)")
    p.add_argument("--model", help="the HF directory or hub id (org/name[@revision]) the run started from (default: "
                                   "the base a LoRA checkpoint names in base_ref.json, else model.path of the run's config, "
                                   "at the hub commit the run recorded)")
    p.add_argument("--adapter-only", action="store_true", help="a run with <role>.lora: write the PEFT adapter directory "
                                                                "(loads onto the base model with peft) instead of the merged model")
    args = p.parse_args(argv)

    ckpt = Path(args.ckpt)
    if args.role is None:  # an SFT checkpoint holds actor/, a reward model's critic/ (megarl.supervised)
        args.role = "critic" if (ckpt / "critic").is_dir() and not (ckpt / "actor").is_dir() else "actor"
    if not (ckpt / "trainer.pt").is_file() or not (ckpt / args.role).is_dir():
        print(f"error: {ckpt} is not a complete megarl checkpoint with a {args.role}/ directory", file=sys.stderr)
        return 2
    model_dir = args.model
    resolved = ckpt.parent.parent / "config.yaml"
    run_config = yaml.safe_load(resolved.read_text()) if resolved.is_file() else None
    # a LoRA checkpoint holds only the adapters: the base comes from the directory it names
    recorded_base = base_ref.recorded_base(ckpt / args.role)
    if model_dir is None and recorded_base is not None:
        model_dir = recorded_base
    if model_dir is None:
        if run_config is None:
            print(f"error: pass --model (no resolved config at {resolved})", file=sys.stderr)
            return 2
        critic_path = (run_config.get("critic") or {}).get("model_path") if args.role == "critic" else None
        key = "critic.model_path" if critic_path else "model.path"  # the critic's trunk (a reward model's too)
        model_dir = hub.recorded_ref(ckpt.parent.parent, key, critic_path or run_config["model"]["path"])
    # The run's banned tokens are part of the policy it trained: they go into generation_config.json.
    banned = tuple((run_config or {}).get("rollout", {}).get("banned_token_ids") or ())
    dims = dims_from_env().initialize()
    try:
        model_dir = hub.local_path_on_each_node(model_dir, "--model")
    except hub.HubError as err:
        if dims.rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    problem = base_ref.changed_base(ckpt / args.role, model_dir, "--model", otherwise="the one the run trained on")
    if problem is not None:
        if dims.rank == 0:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    critic = args.role == "critic"
    lora_cfg = ((run_config or {}).get(args.role) or {}).get("lora") or {}
    options = None
    if lora_cfg.get("rank"):  # the adapters are in the checkpoint: build them to load them
        targets = lora_cfg.get("target_modules")
        options = LoraOptions(rank=int(lora_cfg["rank"]), alpha=float(lora_cfg.get("alpha", 16.0)),
                              dropout=float(lora_cfg.get("dropout", 0.0)), key=f"{args.role}.lora",
                              target_modules=tuple(targets) if targets is not None else None)
    if args.adapter_only and (options is None or critic):
        if dims.rank == 0:
            print(f"error: --adapter-only needs a run with actor.lora.rank > 0 and --role actor ({ckpt})", file=sys.stderr)
        return 2
    engine = MegatronEngine(model_dir, dims, EngineConfig(lora=options), value_head=critic, trainable=False)
    engine.load(str(ckpt / args.role))
    if args.adapter_only:
        try:
            engine.save_peft_adapter(args.out, model_dir)
        except ValueError as err:
            if dims.rank == 0:
                print(f"error: {err}", file=sys.stderr)
            return 2
        if dims.rank == 0:
            print(f"wrote {args.out} (PEFT adapter for {model_dir})")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    engine.save_hf_checkpoint(args.out, model_dir, banned_token_ids=banned)  # under LoRA: the merged model
    if dims.rank == 0:
        suppressed = f" (generation_config.json suppress_tokens {list(banned)}: the run's rollout.banned_token_ids)" if banned and not critic else ""
        print(f"wrote {args.out}{suppressed}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(export_hf_main())
