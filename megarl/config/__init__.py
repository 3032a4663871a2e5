"""Typed run configuration, in four parts with one job each:

    schema      the dataclasses: every knob one field with help text and bounds
    loader      YAML file + `key=value` overrides -> Config; resolved YAML and flat params out
    validation  values, cross-field rules and layout arithmetic (pure: no disk)
    inputs      what the config names on disk (resume checkpoint, model, data files)
    docs        docs/configuration.md rendered from the schema (`python -m megarl.config --docs`)
    resume_changes  what changed since the checkpoint a run resumes from (megarl.run uses it)

    cfg = load_config("configs/tiny_cpu.yaml", ["actor.optim.lr=1e-3", "trainer.total_steps=5"])
    sizes = validate(cfg, world_size)   # layout arithmetic, before any process group exists
    check_inputs(cfg)                   # files and directories

Every problem is a `ConfigError` (a `ValueError`) with a one-line message naming the key.
"""
from megarl.config.docs import render_docs
from megarl.config.inputs import check_data_files, check_inputs, check_model_path, check_monitor_packages, check_resume_path
from megarl.config.loader import all_keys, apply_override, flatten, load_config, save_resolved, to_dict
from megarl.config.schema import (
    ADV_ESTIMATORS_WITH_GROUPS,
    ActorConfig,
    AlgorithmConfig,
    ArithmeticDataConfig,
    Config,
    ConfigError,
    CriticConfig,
    DataConfig,
    GuardsConfig,
    KLControlConfig,
    KLKind,
    LOGGERS,
    LossAggMode,
    MakeTinyConfig,
    ModelConfig,
    ParallelConfig,
    RefConfig,
    RewardConfig,
    RoleConfig,
    RoleOptimConfig,
    RolloutConfig,
    TrackingConfig,
    TrainerConfig,
)
from megarl.config.validation import BatchSizes, validate

__all__ = [
    "ADV_ESTIMATORS_WITH_GROUPS", "ActorConfig", "AlgorithmConfig", "ArithmeticDataConfig", "BatchSizes", "Config",
    "ConfigError", "CriticConfig", "DataConfig", "GuardsConfig", "KLControlConfig", "KLKind", "LOGGERS", "LossAggMode",
    "MakeTinyConfig", "ModelConfig", "ParallelConfig", "RefConfig", "RewardConfig", "RoleConfig", "RoleOptimConfig",
    "RolloutConfig", "TrackingConfig", "TrainerConfig", "all_keys", "apply_override", "check_data_files",
    "check_inputs", "check_monitor_packages", "check_model_path", "check_resume_path", "flatten", "load_config", "render_docs",
    "save_resolved", "to_dict", "validate",
]
