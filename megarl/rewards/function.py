"""User reward functions given as 'module:function' (reward.kind=function).

The function scores one response with verl's custom-reward signature, so verl reward files work
unchanged:

    def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float

It may return a float or a dict with a "score" entry. `module` is an importable module name or a
path to a .py file.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

from megarl.config import ConfigError


def load_function(spec: str) -> Callable:
    """Import 'module:function'; a missing module or function is a ConfigError naming it."""
    module_name, sep, func_name = spec.rpartition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"reward.function: expected 'module:function', got {spec!r}")
    try:
        if module_name.endswith(".py") or os.path.isfile(module_name):
            if not os.path.isfile(module_name):
                raise FileNotFoundError(f"no such file {module_name}")
            loader_spec = importlib.util.spec_from_file_location(
                f"megarl_user_reward_{abs(hash(os.path.abspath(module_name)))}", module_name)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure is the user's module, report it in one line
        raise ConfigError(f"reward.function: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(f"reward.function: module {module_name!r} has no function {func_name!r}"
                          f" (callables there: {', '.join(public) or 'none'})")
    return func


class UserFunctionReward:
    """RewardFn that calls a per-response user function."""

    def __init__(self, spec: str):
        self.spec = spec
        self.func = load_function(spec)

    def __call__(self, prompts, responses, ground_truths, data_sources, extras) -> list[float]:
        scores = []
        for response, truth, source, extra in zip(responses, ground_truths, data_sources, extras):
            out = self.func(data_source=source, solution_str=response, ground_truth=truth, extra_info=extra)
            if isinstance(out, dict):
                out = out["score"]
            scores.append(float(out))
        return scores
