"""Agents: tools an environment calls while a policy acts, and the code sandbox.

`megarl.agents.sandbox.run_python` runs model-written Python in a locked-down process;
`megarl.agents.tools.ToolExecutor` runs an environment's calls concurrently with a per-call
timeout, turning failures into observations. Neither imports torch: an environment may use them
outside the trainer.
"""
from megarl.agents.environment import Environment, Turn
from megarl.agents.sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, run_python
from megarl.agents.tools import CallOutcome, ToolExecutor

__all__ = ["Environment", "Turn", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python", "CallOutcome", "ToolExecutor"]
