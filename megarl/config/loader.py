"""YAML <-> `Config`: reading a file, `key=value` overrides, typed construction, and writing the
resolved config back out.

    cfg = load_config("configs/tiny_cpu.yaml", ["actor.optim.lr=1e-3", "trainer.total_steps=5"])

`load_config` ends with `validate(cfg)` (values only, no disk, no world size); the launcher then
runs the layout arithmetic (`validate(cfg, world_size)`) and the disk checks (`check_inputs`).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

import yaml

from megarl.config.schema import Config, ConfigError, convert, field_name, hints, yaml_key
from megarl.config.validation import validate


class _DuplicateKey(ValueError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"key {key!r} appears twice in one section (lines {seen[key] + 1} and "
                                    f"{key_node.start_mark.line + 1}); keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (None = all defaults), apply `key=value` overrides, check values."""
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            with open(path) as f:
                raw = yaml.load(f, Loader=_UniqueKeyLoader) or {}
        except _DuplicateKey as e:
            raise ConfigError(f"{path}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of config sections, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    cfg = _build(Config, raw, "", Config())
    validate(cfg)
    return cfg


def apply_override(raw: dict, item: str) -> None:
    """Set one dotted `key=value` (value parsed as YAML: 1e-6, true, [a,b], null) in a raw dict."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. actor.optim.lr=1e-6)")
    _check_key(key)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text  # e.g. an unbalanced bracket in a path: keep it as the plain string
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: expected a mapping, got {child!r}")
        node = child
    node[parts[-1]] = value


def all_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema, e.g. 'actor.optim.lr'."""
    cls = cls or Config
    keys = []
    for f in dataclasses.fields(cls):
        tp = hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, f"{prefix}{yaml_key(f.name)}.")
        else:
            keys.append(f"{prefix}{yaml_key(f.name)}")
    return keys


def _check_key(key: str) -> None:
    cls = Config
    for part in key.split("."):
        part = field_name(part)
        if cls is None or part not in hints(cls):
            raise _unknown_key(key)
        tp = hints(cls)[part]
        cls = tp if dataclasses.is_dataclass(tp) else None


# verl spellings users bring along, mapped to ours (difflib would not find these).
_VERL_NAMES = {
    "rollout.n": "rollout.samples_per_prompt",
    "rollout.response_length": "rollout.max_new_tokens",
    "data.train_batch_size": "data.prompts_per_step",
    "data.max_prompt_length": "data.max_prompt_tokens",
    "data.max_response_length": "rollout.max_new_tokens",
    "actor.ppo_mini_batch_size": "actor.ppo_mini_batches",
    "actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_microbatch",
    "critic.cliprange_value": "critic.vf_clip",
    "model.use_remove_padding": "model.sequence_packing",
    "trainer.save_freq": "trainer.save_every_steps",
    "trainer.total_training_steps": "trainer.total_steps",
}


def _unknown_key(key: str) -> ConfigError:
    if key in _VERL_NAMES:
        return ConfigError(f"unknown config key '{key}' (a verl name); megarl's key is "
                           f"'{_VERL_NAMES[key]}', check its unit in docs/configuration.md")
    keys = all_keys()
    leaf = key.rsplit(".", 1)[-1]
    # A known leaf in the wrong place (trainer.gamma -> algorithm.gamma) beats spelling distance.
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    close = (difflib.get_close_matches(key, same_leaf, n=1, cutoff=0)
             or difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
             or difflib.get_close_matches(key, sorted({k.rsplit(".", 1)[0] for k in keys}), n=1, cutoff=0.6))
    hint = f"; did you mean '{close[0]}'?" if close else " (see docs/configuration.md)"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _build(cls: type, data: Any, prefix: str, base: Any) -> Any:
    """Make a `cls` from a mapping, starting from `base` (the parent's default for this section)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    types_of = hints(cls)
    data = {field_name(key): value for key, value in data.items()}
    for key in data:
        if key not in types_of:
            raise _unknown_key(f"{prefix}{yaml_key(key)}")
    values = {}
    for f in dataclasses.fields(cls):
        default, key = getattr(base, f.name), yaml_key(f.name)
        if f.name not in data:
            values[f.name] = default
        elif dataclasses.is_dataclass(types_of[f.name]):
            values[f.name] = _build(types_of[f.name], data[f.name], f"{prefix}{key}.", default)
        else:
            values[f.name] = convert(data[f.name], types_of[f.name], f"{prefix}{key}")
    return cls(**values)


# --- output: resolved YAML, flat params ---------------------------------------------------

def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples become lists) that yaml.safe_dump can write."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {yaml_key(k): plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def flatten(cfg: Config) -> dict[str, Any]:
    """{'actor.optim.lr': 1e-6, ...} for experiment trackers."""
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v
    walk(to_dict(cfg), "")
    return out


def save_resolved(cfg: Config, path: str | os.PathLike, footer: str = "") -> None:
    """Write the fully resolved config as YAML (loadable by load_config); `footer`: comment lines
    appended (the hub snapshots the run's models resolved to, megarl.hub.describe)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("# Resolved megarl config: every key, after the config file and overrides.\n")
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False, default_flow_style=None)
        f.write(footer)
