"""Checks of what a config names on disk: the resume checkpoint, the model and the data files.

Separate from `validate` (pure) because the answers depend on the machine and the moment: the
launcher runs them once, after the config is valid and before any process group or model is
built, so a user sees one line naming the problem instead of a traceback.
"""
from __future__ import annotations

import os

from megarl import checkpoint_io
from megarl.config.schema import Config, ConfigError


def check_inputs(cfg: Config) -> None:
    """Every disk check, in the order a user would fix them."""
    check_resume_path(cfg.trainer.resume)
    check_model_path(cfg)
    check_data_files(cfg)


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


def check_data_files(cfg: Config) -> None:
    if cfg.data.auto_prepare is None:
        for path in cfg.data.train_files:
            if not os.path.isfile(path):
                raise ConfigError(f"data.train_files: {path} does not exist (write it with launch/prepare_data.py, "
                                  f"or set data.auto_prepare)")
