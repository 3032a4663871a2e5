"""megarl.runtime.profiling: ranges only inside a recorded step, a Chrome trace per rank, NVTX refused on CPU."""
from __future__ import annotations

import json

import pytest
import torch

from megarl.runtime import profiling
from megarl.runtime.profiling import StepProfiler, trace_path


def _work():
    with profiling.phase("ppo_step/gen"):
        torch.ones(8, 8) @ torch.ones(8, 8)
    with profiling.phase("sync/bucket_0"):
        torch.zeros(4).add_(1)


def test_only_the_chosen_steps_are_recorded_with_their_named_ranges(tmp_path):
    prof = StepProfiler("torch", [2], tmp_path, rank=3)
    for step in (1, 2, 3):
        with prof.step(step):
            if step != 2:  # outside a recorded step every range is the one shared null context
                assert profiling.phase("ppo_step/gen") is profiling.phase("x") is profiling._NULL
            _work()
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["step_00000002"]
    trace = json.loads(trace_path(tmp_path, 2, 3).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ppo_step 2", "ppo_step/gen", "sync/bucket_0"} <= names
    assert profiling._active is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_nvtx_without_cuda_is_refused_with_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^trainer.profiler=nvtx records NVTX ranges for Nsight Systems, which needs "
                                         r"CUDA; use trainer.profiler=torch on this machine$"):
        StepProfiler("nvtx", [1], tmp_path, rank=0)
    StepProfiler("nvtx", [], tmp_path, rank=0)  # nothing to record: nothing refused
