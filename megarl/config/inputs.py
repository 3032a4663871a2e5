"""Checks of what a config names on disk: the resume checkpoint, the model and the data files.

Separate from `validate` (pure) because the answers depend on the machine and the moment: the
launcher runs them once, after the config is valid and before any process group or model is
built, so a user sees one line naming the problem instead of a traceback.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

from megarl.checkpointing import checkpoint_io

from megarl import hub
from megarl.config.schema import Config, ConfigError
from megarl.layout import ModelShape, ParallelLayout, check_model, check_rollout_heads, refuse_moe_tensor_parallel
from megarl.models.families import LARGE_MOE_FAMILIES, MOE_FAMILIES, load_spec
from megarl.models.lora_targets import check_targets


def check_inputs(cfg: Config, overrides=()) -> None:
    """Every disk check, in the order a user would fix them. `overrides`: the command line's
    key=value pairs (data files typed there are never auto-prepared)."""
    check_resume_path(cfg.trainer.resume)
    check_model_path(cfg)
    check_model_layout(cfg)
    check_data_files(cfg, overrides)
    check_rollout_engine(cfg)
    check_monitor_packages(cfg)


def check_resume_path(resume: str) -> None:
    """trainer.resume: auto, never, or a complete checkpoint directory."""
    if resume in ("auto", "never"):
        return
    if not os.path.isdir(resume):
        raise ConfigError(f"trainer.resume: {resume!r} is neither auto, never nor an existing checkpoint directory")
    if not checkpoint_io.is_complete(resume):
        raise ConfigError(f"trainer.resume: {resume} has no {checkpoint_io.COMPLETE} marker (an interrupted save?)")


def model_refs(cfg: Config) -> dict[str, hub.HubRef]:
    """{config key: hub id} for every model the run loads that is named by a hub id rather than a
    directory (the reference model is model.path; model.make_tiny's path is always a directory)."""
    named = {"model.path": None if cfg.model.make_tiny.enable else cfg.model.path,
             "critic.model_path": cfg.critic.model_path if cfg.algorithm.adv_estimator == "gae" else None,
             "reward.model_path": cfg.reward.model_path if cfg.reward.kind == "model" else None}
    return {key: ref for key, value in named.items() if (ref := hub.parse_hub_id(value)) is not None}


def with_snapshots(cfg: Config, snapshots: dict[str, hub.Snapshot]) -> Config:
    """A copy of `cfg` whose hub ids are replaced by their snapshot directories: what the trainer loads
    (the run's records keep the ids, with the snapshots beside them: megarl.hub.recorded)."""
    sections = {}
    for key, snap in snapshots.items():
        section, field = key.split(".")
        sections.setdefault(section, {})[field] = snap.path
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **fields)
                                       for name, fields in sections.items()})


def check_model_path(cfg: Config) -> None:
    """Each model a directory, or a hub id: with HF_HUB_OFFLINE set it must be in the cache already
    (a look-up, no network); otherwise it is downloaded once per node after the process groups exist."""
    refs = model_refs(cfg)
    if "model.path" not in refs and not os.path.isdir(cfg.model.path) and not cfg.model.make_tiny.enable:
        raise ConfigError(f"model.path: {cfg.model.path} does not exist (give a Hugging Face model directory or a hub "
                          f"id such as Qwen/Qwen2.5-0.5B-Instruct, or set model.make_tiny.enable=true for a tiny random model)")
    teacher = cfg.algorithm.distill.teacher_path
    if teacher and not os.path.isfile(os.path.join(teacher, "config.json")):
        raise ConfigError(f"algorithm.distill.teacher_path: {teacher} is not a Hugging Face model directory (no config.json); "
                          f"give the teacher's directory (hub ids are not read here: download it first)")
    if hub.offline():
        for key, ref in refs.items():
            if hub.cached(ref) is None:
                raise ConfigError(hub.not_cached_message(ref, key))


def check_model_layout(cfg: Config, model_dirs: dict[str, str] | None = None) -> None:
    """The parallel layout against the model's config.json, with the rules the model builder
    applies (megarl.layout.check_model, training rules included): heads and widths over tp,
    layers over the (uneven, virtual) pipeline stages, experts over ep, expert widths over etp, MoE
    at tp > 1 without sequence parallelism, tied embeddings with vpp; the actor's heads over
    rollout.tp. config.json is read by the model builder's parser
    (megarl.models.families), so a model it cannot build is refused here too. Skipped while the
    model is still to be made or downloaded. The critic's trunk (critic.model_path), a reward model
    (reward.model_path, forward only) and a distillation teacher (algorithm.distill.teacher_path,
    forward only; its vocabulary must be the student's) are checked the same way. `model_dirs`: {config key: local
    directory} of models named by hub id and resolved since (the launcher checks again with them)."""
    resolved = dict(model_dirs or {})

    def local_dir(key: str, path: str) -> str | None:
        """Where the model's files are: a directory, a cached hub snapshot, or None (not yet here)."""
        if key in resolved:
            return resolved[key]
        ref = None if key == "model.path" and cfg.model.make_tiny.enable else hub.parse_hub_id(path)
        if ref is None:
            return path
        snap = hub.cached(ref)
        return None if snap is None else snap.path

    p = cfg.parallel
    model_dir = local_dir("model.path", cfg.model.path)
    try:
        if model_dir is None or not os.path.isfile(os.path.join(model_dir, "config.json")):
            if cfg.model.make_tiny.enable and cfg.model.make_tiny.arch in TINY_MOE_ARCHS:
                refuse_moe_tensor_parallel(p.tp, f"a tiny {cfg.model.make_tiny.arch} (model.make_tiny)", p.sequence_parallel)
            return  # the model is still to be made or downloaded
    except ValueError as err:
        raise ConfigError(f"{err} ({cfg.model.path})") from None
    # world-independent: dp = etp * ep makes every expert split divide, so only the model's rules speak
    layout = ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp, first_stage_layers=p.first_stage_layers,
                            last_stage_layers=p.last_stage_layers, dp=(p.etp or p.tp) * p.ep,
                            sequence_parallel=p.sequence_parallel)
    # Every model built on this layout: the actor (and reference), the critic's trunk (trained), a
    # reward model (forward only).
    models = [("model.path", cfg.model.path, True)]
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.model_path:
        models.append(("critic.model_path", cfg.critic.model_path, True))
    if cfg.reward.kind == "model" and cfg.reward.model_path:
        models.append(("reward.model_path", cfg.reward.model_path, False))
    if cfg.algorithm.distill.teacher_path:  # forward only, laid out as the reference model
        models.append(("algorithm.distill.teacher_path", cfg.algorithm.distill.teacher_path, False))
    vocab_sizes = {}
    for key, path, training in models:
        directory = local_dir(key, path)
        if directory is None:
            continue  # a hub id not yet downloaded: the launcher checks again with its snapshot
        try:
            spec = load_spec(directory)  # UnsupportedModelError: the loader's message, here before any model exists
            check_model(ModelShape.of_spec(spec), layout, training=training)
            vocab_sizes[key] = spec.vocab_size
            if key == "model.path" and cfg.rollout.tp > 1:  # the actor's weights go into the rollout engine
                check_rollout_heads(ModelShape.of_spec(spec), cfg.rollout.tp)
            for role in _lora_roles(cfg, key):
                check_targets(getattr(cfg, role).lora.target_modules, spec, f"{role}.lora")
        except ValueError as err:
            raise ConfigError(f"{err} ({key} {path})") from None
    teacher_vocab, student_vocab = vocab_sizes.get("algorithm.distill.teacher_path"), vocab_sizes.get("model.path")
    if None not in (teacher_vocab, student_vocab) and teacher_vocab != student_vocab:
        raise ConfigError(f"algorithm.distill.teacher_path: the teacher's vocabulary has {teacher_vocab} tokens, the student's "
                          f"(model.path) {student_vocab}: the teacher scores the student's token ids, so it needs the "
                          f"student's tokenizer")


def _lora_roles(cfg: Config, key: str) -> list[str]:
    """The roles with adapters on the model of config key `key`."""
    critic_here = cfg.algorithm.adv_estimator == "gae" and (key == "critic.model_path" or
                                                             (key == "model.path" and not cfg.critic.model_path))
    roles = (["actor"] if key == "model.path" else []) + (["critic"] if critic_here else [])
    return [r for r in roles if getattr(cfg, r).lora.rank > 0]


TINY_MOE_ARCHS = MOE_FAMILIES + LARGE_MOE_FAMILIES


def check_data_files(cfg: Config, overrides=()) -> None:
    """Missing data files are an error, except the config file's own paths under data.auto_prepare
    (written at start-up); a path typed on the command line is never generated (issue 11)."""
    # deferred: megarl.data loads pyarrow and numpy, which a config check without data files does not need
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
    """rollout.engine=vllm / sglang needs that package here (the hf engine is always there); under
    rollout.placement=fleet the servers run the engine and import it (megarl.rollout.serve), not the
    training job."""
    engine = cfg.rollout.engine
    if engine == "hf" or cfg.rollout.placement == "fleet":
        return
    spec = importlib.util.find_spec(engine)
    if spec is None or spec.origin in (None, "namespace"):
        raise ConfigError(f"rollout.engine={engine}: the {engine} package is not installed here; install it with "
                          f"pip install 'megarl[{engine}]' on a machine with CUDA, or use rollout.engine=hf")


# What each optional monitor needs; all of them come with `pip install 'megarl[monitor]'`.
MONITOR_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "prometheus": ("prometheus_client", "prometheus-client")}


def check_monitor_packages(cfg: Config) -> None:
    """The packages of the chosen loggers and of the metrics endpoint are installed."""
    wanted = [name for name in cfg.tracking.active_loggers() if name in MONITOR_PACKAGES]
    if cfg.tracking.prometheus_port is not None:
        wanted.append("prometheus")
    for name in wanted:
        module, dist = MONITOR_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            key = "tracking.prometheus_port" if name == "prometheus" else f"tracking.loggers: {name}"
            raise ConfigError(f"{key} needs the {dist} package, which is not installed: "
                              f"pip install 'megarl[monitor]' (or pip install {dist})")
