"""megarl.agents.python_tool (the GSM8K tool config's environment): a turn's ```python block runs in
the sandbox and its output is the observation; a turn without one is the final answer."""
from __future__ import annotations

from megarl.agents import Turn
from megarl.agents.python_tool import PythonTool, code_block
from test_sandbox import needs_sandbox


def test_code_block_is_the_last_fenced_block():
    assert code_block("Let me compute.\n```python\nprint(6 * 7)\n```\nDone") == "print(6 * 7)\n"
    assert code_block("```py\na = 1\n```\n```python\nprint(2)\n```") == "print(2)\n"
    assert code_block("cut off at the turn's end\n```python\nprint(1 +") == "print(1 +"
    assert code_block("#### 42") is None


def test_a_turn_without_code_ends_the_episode():
    assert PythonTool().step(Turn("The answer is 42.\n#### 42", ())) == (None, 0.0, True)


@needs_sandbox
def test_code_runs_in_the_sandbox_and_its_output_comes_back():
    env = PythonTool()
    observation, reward, done = env.step(Turn("```python\nimport os\nprint(6 * 7, os.getcwd())\n```", ()))
    assert (observation, reward, done) == ("<output>\n42 /sandbox\n</output>\n", 0.0, False)
    observation, _, _ = env.step(Turn("```python\n1 / 0\n```", ()))
    assert "ZeroDivisionError" in observation and observation.endswith("[exit code 1]\n</output>\n")
