"""docs/configuration.md, rendered from the schema's fields (`python -m megarl.config --docs`)."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

import yaml

from megarl.config.schema import Config, hints, yaml_key


_DOCS_INTRO = """\
# Configuration reference

Generated from `megarl/config/schema.py` by `python -m megarl.config --docs > docs/configuration.md`;
a test fails when this file is out of date.

A run is one YAML file plus `key=value` overrides on the command line:

    torchrun --standalone --nproc_per_node 2 launch/ppo.py --config configs/tiny_cpu.yaml \\
        actor.optim.lr=5e-4 trainer.total_steps=20 data.train_files=[a.parquet,b.parquet]

Override values are parsed as YAML (`1e-6`, `true`, `[a,b]`, `null`). Before any process group or
model is built, the config is checked and every problem is one line naming the key: an unknown key
(with the closest valid one), a wrong type, a value out of range or not among the allowed values,
and the layout arithmetic for the world size (for example `world size 6 is not divisible by
parallel.tp * parallel.pp * parallel.cp = 2 * 2 * 1 = 4`). The resolved config is written to
`<trainer.run_dir>/config.yaml`.

Sizes say their unit and scope: `data.prompts_per_step` counts prompts of the whole step (all
data-parallel ranks); the step trains on `prompts_per_step * rollout.samples_per_prompt`
responses, split into `ppo_mini_batches` optimizer steps per epoch; `max_tokens_per_microbatch`
is per data-parallel rank. The data-parallel size is world size / (tp * pp * cp).

Metrics go to `<trainer.run_dir>/metrics.jsonl` and, by default, to an MLflow store in the run
directory: `mlflow ui --backend-store-uri sqlite:///<trainer.run_dir>/mlflow.db`. TensorBoard, W&B,
live Prometheus metrics and profiles: `tracking.loggers`, `tracking.prometheus_port`,
`trainer.profile_steps` below, and docs/operations.md ("Watching a run").
"""


def render_docs() -> str:
    """Markdown reference of every key, generated from the schema."""
    lines = [_DOCS_INTRO]

    def emit(section_default, prefix, title, help):
        """One table per section; defaults come from the parent's default (critic lr 1e-5)."""
        cls = type(section_default)
        lines.extend([f"## `{title}`", "", help[:1].upper() + help[1:] + ".", "",
                      "| key | type | default | description |", "|---|---|---|---|"])
        nested = []
        for f in dataclasses.fields(cls):
            tp, default = hints(cls)[f.name], getattr(section_default, f.name)
            if dataclasses.is_dataclass(tp):
                nested.append((default, f"{prefix}{yaml_key(f.name)}", f.metadata["help"]))
                continue
            bounds = [f"{w} {f.metadata[b]}" for b, w in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                      if b in f.metadata]
            kind = ", ".join([_type_name(tp)] + bounds)
            help_text = f.metadata["help"].replace("|", "\\|")
            lines.append(f"| `{prefix}{yaml_key(f.name)}` | {kind} | `{_yaml_scalar(default)}` | {help_text} |")
        lines.append("")
        for default, name, help in nested:
            emit(default, name + ".", name, help)

    defaults = Config()
    for f in dataclasses.fields(Config):
        emit(getattr(defaults, f.name), f"{yaml_key(f.name)}.", yaml_key(f.name), f.metadata["help"])
    return "\n".join(lines)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _type_name(next(a for a in args if a is not type(None))) + " or null"
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}"
    return {bool: "bool", int: "int", float: "float", str: "str"}[tp]


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, tuple):
        v = list(v)
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
