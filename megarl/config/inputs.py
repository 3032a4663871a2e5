"""Checks of what a config names on disk: the resume checkpoint, the model and the data files.

Separate from `validate` (pure) because the answers depend on the machine and the moment: the
launcher runs them once, after the config is valid and before any process group or model is
built, so a user sees one line naming the problem instead of a traceback.
"""
from __future__ import annotations

import dataclasses
import os

from megarl import checkpoint_io, hub
from megarl.config.schema import Config, ConfigError


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
    if hub.offline():
        for key, ref in refs.items():
            if hub.cached(ref) is None:
                raise ConfigError(hub.not_cached_message(ref, key))


def check_model_layout(cfg: Config, model_dir: str | None = None) -> None:
    """The parallel layout against the model's config.json (read by the planner's torch-free
    `megarl.plan.arch`): heads over tp, layers over the pipeline stages (uneven end stages, vpp
    chunks), experts over ep, expert widths over etp. Skipped while the model is still to be made
    or downloaded. `model_dir`: where model.path's files are (its hub snapshot), default model.path."""
    from megarl.plan.arch import arch_from_config, load_config, stage_layers

    if model_dir is None:
        ref = None if cfg.model.make_tiny.enable else hub.parse_hub_id(cfg.model.path)
        snap = hub.cached(ref) if ref is not None else None
        if ref is not None and snap is None:
            return  # to be downloaded: the launcher checks again with the snapshot
        model_dir = cfg.model.path if snap is None else snap.path
    path = os.path.join(model_dir, "config.json")
    p = cfg.parallel
    if not os.path.isfile(path):
        if cfg.model.make_tiny.enable and cfg.model.make_tiny.arch in TINY_MOE_ARCHS:
            check_moe_tensor_parallel(p.tp, f"a tiny {cfg.model.make_tiny.arch} (model.make_tiny)")
        return
    try:
        arch = arch_from_config(load_config(path))
    except ValueError:
        return  # not a family the planner knows: the model loader reports it with its own message
    etp = p.etp or p.tp
    checks = [(arch.heads, p.tp, "attention heads", "parallel.tp"), (arch.kv_heads, p.tp, "key/value heads", "parallel.tp")]
    if arch.experts:
        checks += [(arch.experts, p.ep, "routed experts", "parallel.ep"), (arch.moe_ffn, etp, "expert ffn width", "parallel.etp")]
    elif p.ep > 1:
        raise ConfigError(f"parallel.ep = {p.ep} needs a mixture-of-experts model; {cfg.model.path} is a dense {arch.model_type}")
    for count, size, what, key in checks:
        if count % size:
            raise ConfigError(f"{key} = {size} does not divide the model's {count} {what} ({cfg.model.path})")
    if arch.experts:
        check_moe_tensor_parallel(p.tp, f"{cfg.model.path} (a {arch.model_type} mixture-of-experts model)")
    if p.vpp and p.vpp > 1 and arch.tie_embeddings:
        raise ConfigError(f"parallel.vpp = {p.vpp} with a model whose embeddings are tied ({cfg.model.path}): Megatron-Core's "
                          f"optimizer checkpoint does not restore this combination correctly; use parallel.vpp=null")
    try:
        stage_layers(arch.num_layers, p.pp, p.first_stage_layers, p.last_stage_layers, p.vpp)
    except ValueError as err:
        raise ConfigError(f"parallel.pp / first_stage_layers / last_stage_layers / vpp: {err} ({cfg.model.path})") from None


TINY_MOE_ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe")


def check_moe_tensor_parallel(tp: int, model: str) -> None:
    """MoE training at parallel.tp > 1 is refused: Megatron-Core's MoE layer supports it only with
    sequence parallelism, which megarl does not have. Without it every TP rank holds the whole
    sequence and the token dispatcher gathers it once per TP rank, so each expert sees every token
    tp times and its gradient comes out tp times too large (measured: tests/moe); Megatron-Core
    refuses the combination in training. Forward-only tools (megarl.tools.logprobs) may use tp > 1."""
    if tp > 1:
        raise ConfigError(f"parallel.tp = {tp} with {model}: MoE training needs sequence parallelism at tp > 1, "
                          f"which megarl does not have; use parallel.tp=1 and split the model with parallel.ep / "
                          f"parallel.etp / parallel.pp")


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


# What each optional monitor needs; all of them come with `pip install 'megarl[monitor]'`.
MONITOR_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "prometheus": ("prometheus_client", "prometheus-client")}


def check_monitor_packages(cfg: Config) -> None:
    """The packages of the chosen loggers and of the metrics endpoint are installed."""
    import importlib.util

    wanted = [name for name in cfg.tracking.active_loggers() if name in MONITOR_PACKAGES]
    if cfg.tracking.prometheus_port is not None:
        wanted.append("prometheus")
    for name in wanted:
        module, dist = MONITOR_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            key = "tracking.prometheus_port" if name == "prometheus" else f"tracking.loggers: {name}"
            raise ConfigError(f"{key} needs the {dist} package, which is not installed: "
                              f"pip install 'megarl[monitor]' (or pip install {dist})")
