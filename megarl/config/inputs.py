"""Checks of what a config names on disk: the resume checkpoint, the model and the data files.

Separate from `validate` (pure) because the answers depend on the machine and the moment: the
launcher runs them once, after the config is valid and before any process group or model is
built, so a user sees one line naming the problem instead of a traceback.
"""
from __future__ import annotations

import os

from megarl import checkpoint_io
from megarl.config.schema import Config, ConfigError
from megarl.layout import ParallelLayout


def check_inputs(cfg: Config, overrides=()) -> None:
    """Every disk check, in the order a user would fix them. `overrides`: the command line's
    key=value pairs (data files typed there are never auto-prepared)."""
    check_resume_path(cfg.trainer.resume)
    check_model_path(cfg)
    check_model_layout(cfg)
    check_data_files(cfg, overrides)
    check_rollout_engine(cfg)


def check_resume_path(resume: str) -> None:
    """trainer.resume: auto, never, or a complete checkpoint directory."""
    if resume in ("auto", "never"):
        return
    if not os.path.isdir(resume):
        raise ConfigError(f"trainer.resume: {resume!r} is neither auto, never nor an existing checkpoint directory")
    if not checkpoint_io.is_complete(resume):
        raise ConfigError(f"trainer.resume: {resume} has no {checkpoint_io.COMPLETE} marker (an interrupted save?)")


def check_model_path(cfg: Config) -> None:
    if not os.path.isdir(cfg.model.path) and not cfg.model.make_tiny.enable:
        raise ConfigError(f"model.path: {cfg.model.path} does not exist (give a Hugging Face model directory, "
                          f"or set model.make_tiny.enable=true for a tiny random model)")


def check_model_layout(cfg: Config) -> None:
    """The parallel layout against the model's config.json, with the rules the model builder
    applies (megarl.layout.check_model, training rules included): heads and widths over tp,
    layers over the (uneven, virtual) pipeline stages, experts over ep, expert widths over etp, MoE
    at tp > 1, tied embeddings with vpp. config.json is read by the model builder's parser
    (megarl.models.families), so a model it cannot build is refused here too. Skipped while the
    model is still to be made. The critic's trunk (critic.model_path) and a reward model
    (reward.model_path, forward only) are checked the same way."""
    from megarl.layout import ModelShape, check_model, refuse_moe_tensor_parallel
    from megarl.models.families import load_spec

    p = cfg.parallel
    try:
        if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
            if cfg.model.make_tiny.enable and cfg.model.make_tiny.arch in TINY_MOE_ARCHS:
                refuse_moe_tensor_parallel(p.tp, f"a tiny {cfg.model.make_tiny.arch} (model.make_tiny)")
            return  # the model is still to be made
    except ValueError as err:
        raise ConfigError(f"{err} ({cfg.model.path})") from None
    # world-independent: dp = etp * ep makes every expert split divide, so only the model's rules speak
    layout = ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp, first_stage_layers=p.first_stage_layers,
                            last_stage_layers=p.last_stage_layers, dp=(p.etp or p.tp) * p.ep)
    # Every model built on this layout: the actor (and reference), the critic's trunk (trained), a
    # reward model (forward only).
    models = [("model.path", cfg.model.path, True)]
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.model_path:
        models.append(("critic.model_path", cfg.critic.model_path, True))
    if cfg.reward.kind == "model" and cfg.reward.model_path:
        models.append(("reward.model_path", cfg.reward.model_path, False))
    for key, path, training in models:
        try:
            spec = load_spec(path)  # UnsupportedModelError: the loader's message, here before any model exists
            check_model(ModelShape.of_spec(spec), layout, training=training)
        except ValueError as err:
            raise ConfigError(f"{err} ({key} {path})") from None


TINY_MOE_ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe")


def check_data_files(cfg: Config, overrides=()) -> None:
    """Missing data files are an error, except the config file's own paths under data.auto_prepare
    (written at start-up); a path typed on the command line is never generated (issue 11)."""
    from megarl.data.dataset import data_file_problem
    from megarl.data.prepare import user_data_files

    typed = user_data_files(cfg.data, overrides)
    for key, paths in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for path in paths:
            problem = data_file_problem(path)
            if problem is None or (cfg.data.auto_prepare is not None and path not in typed and not os.path.isdir(path)):
                continue
            if cfg.data.auto_prepare is None:
                fix = "write it with launch/prepare_data.py, or set data.auto_prepare"
            else:
                fix = "data.auto_prepare writes only the config file's own paths, not one given on the command line: " \
                      "write it with launch/prepare_data.py"
            raise ConfigError(f"{key}: data file {problem} ({fix})")


def check_rollout_engine(cfg: Config) -> None:
    """rollout.engine=vllm / sglang needs that package here (the hf engine is always there)."""
    import importlib.util

    engine = cfg.rollout.engine
    if engine == "hf":
        return
    spec = importlib.util.find_spec(engine)
    if spec is None or spec.origin in (None, "namespace"):
        raise ConfigError(f"rollout.engine={engine}: the {engine} package is not installed here; install it with "
                          f"pip install 'megarl[{engine}]' on a machine with CUDA, or use rollout.engine=hf")
