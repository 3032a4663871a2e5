"""NaN or inf rewards fail the run with a message naming the reward function and the samples
(issue 11, item 7), instead of skipping every update and exiting 0 with a null score."""
from __future__ import annotations

import textwrap

import pytest

from conftest import REPO, torchrun

from megarl.config import RewardConfig
from megarl.rewards import RewardError, build_reward_fn


def _reward_file(tmp_path, body):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return f"{path}:compute_score"


def test_nan_and_inf_scores_name_the_function_and_the_samples(tmp_path):
    spec = _reward_file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            return {"1": float("nan"), "2": float("inf")}.get(solution_str, 1.0)
    """)
    fn = build_reward_fn(RewardConfig(kind="function", function=spec))
    assert fn(["p"] * 2, ["0", "9"], ["", ""], ["s", "s"], [{}, {}]) == [1.0, 1.0]
    with pytest.raises(RewardError) as info:
        fn(["a=", "b=", "c="], ["0", "1", "2"], ["", "", ""], ["s"] * 3, [{}] * 3)
    message = str(info.value)
    assert f"reward reward.function={spec} returned 2 non-finite" in message
    assert "sample 1: score nan for prompt 'b=' response '1'" in message and "sample 2: score inf" in message


def test_non_numeric_scores_and_wrong_counts_are_refused():
    class Broken:
        def __call__(self, prompts, responses, *rest):
            return ["high"] + [0.0] * (len(responses) - 1)

    fn = build_reward_fn(RewardConfig(kind="model", model_path="rm"), reward_model=Broken())
    with pytest.raises(RewardError, match=r"reward.model_path=rm returned 1 .*score 'high'"):
        fn(["p", "q"], ["r", "s"], ["", ""], ["", ""], [{}, {}])


TWO_RANKS = textwrap.dedent("""
    import os, sys, torch.distributed as dist
    from megarl.config import RewardConfig
    from megarl.rewards import RewardError, build_reward_fn
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fn = build_reward_fn(RewardConfig(kind="function", function=sys.argv[1]))
    try:  # only rank 1's responses are bad; both ranks must fail, with the same message
        fn(["p"], ["bad" if rank == 1 else "ok"], [""], [""], [{}])
    except RewardError as e:
        sys.stdout.write(f"rank {rank}: {e}\\n")  # one write: two ranks' print()s can interleave mid-line
        sys.stdout.flush()
    dist.destroy_process_group()
""")


@pytest.mark.multiprocess
def test_a_bad_score_on_one_rank_fails_every_rank(tmp_path):
    spec = _reward_file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            return float("nan") if solution_str == "bad" else 0.5
    """)
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    out = torchrun(2, [str(script), spec], timeout=300, env={"PYTHONPATH": str(REPO)})
    lines = sorted(l for l in out.stdout.splitlines() if l.startswith("rank "))
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0].split(": ", 1)[1] == lines[1].split(": ", 1)[1]
    assert "rank 1 sample 0: score nan" in lines[0]
