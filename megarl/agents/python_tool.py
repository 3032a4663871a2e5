"""A Python code tool for multi-turn RL (configs/qwen2.5-0.5b-gsm8k-tool.yaml): a policy turn with a
```python fenced block runs that code in megarl.agents.sandbox.run_python (no network, no host
files, no trainer environment, CPU / memory / process / output limits) and gets its output back;
a turn without one is the final answer and ends the episode.

    rollout.multi_turn.environment: megarl.agents.python_tool:PythonTool
"""
from __future__ import annotations

import re

from megarl.agents.environment import Environment, Turn
from megarl.agents.sandbox import run_python

_CODE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
TIMEOUT_S = 10.0  # wall time of one program (its CPU time is capped by SandboxLimits.cpu_s)
MAX_OUTPUT_CHARS = 1000  # of the observation (the end kept: tracebacks end with the error)


def code_block(text: str) -> str | None:
    """The last ```python block of a turn (an unterminated one counts up to the turn's end)."""
    blocks = _CODE.findall(text)
    if blocks:
        return blocks[-1]
    tail = re.search(r"```(?:python|py)?[ \t]*\n(.*)$", text, re.DOTALL)
    return tail.group(1) if tail else None


class PythonTool(Environment):
    """Runs the turn's code block; its output is the observation, wrapped in <output> tags."""

    def reset(self, row: dict) -> None:
        return None

    def step(self, turn: Turn) -> tuple[str | None, float, bool]:
        code = code_block(turn.text)
        if code is None:
            return None, 0.0, True
        result = run_python(code, timeout_s=TIMEOUT_S)
        return f"<output>\n{result.observation(MAX_OUTPUT_CHARS)}</output>\n", 0.0, False
