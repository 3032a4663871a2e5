"""ParallelDims: validation with the arithmetic in the message, derived dp, and (4 processes) the
process groups it builds through Megatron's parallel_state."""
from __future__ import annotations

import json
import re

import pytest

from conftest import torchrun
from megarl.parallel import ParallelDims


def test_dp_is_derived():
    assert ParallelDims(world_size=8, tp=2, pp=2).dp == 2
    assert ParallelDims(world_size=8, tp=2, cp=2).dp == 2
    assert ParallelDims(world_size=6, tp=3).dp == 2
    assert ParallelDims(world_size=1).dp == 1
    dims = ParallelDims(world_size=16, tp=2, pp=2, ep=4, etp=1)
    assert (dims.model_parallel_size, dims.dp, dims.expert_tp) == (4, 4, 1)
    assert dims.describe() == "world=16 tp=2 pp=2 cp=1 dp=4 ep=4 etp=1"
    assert ParallelDims(world_size=4, tp=2).expert_tp == 2  # etp unset = tp, Megatron's default


def test_world_not_divisible_shows_the_arithmetic():
    with pytest.raises(ValueError, match=re.escape("world size 6 is not divisible by tp*pp*cp = 2*2*1 = 4")) as err:
        ParallelDims(world_size=6, tp=2, pp=2)
    assert "launch a multiple of 4 processes" in str(err.value)
    with pytest.raises(ValueError, match=re.escape("world size 8 is not divisible by tp*pp*cp = 1*3*1 = 3")):
        ParallelDims(world_size=8, pp=3)
    with pytest.raises(ValueError, match=re.escape("tp*pp*cp = 2*1*4 = 8")):
        ParallelDims(world_size=4, tp=2, cp=4)


@pytest.mark.parametrize("field", ["world_size", "tp", "pp", "cp", "ep"])
def test_degrees_must_be_positive_integers(field):
    kwargs = dict(world_size=4)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=rf"parallel\.{field} must be a positive integer, got 0"):
        ParallelDims(**kwargs)
    kwargs[field] = 2.0
    with pytest.raises(ValueError, match=rf"parallel\.{field} must be a positive integer, got 2\.0"):
        ParallelDims(**kwargs)


def test_expert_parallel_constraints():
    # Experts are laid out over etp x ep inside each pipeline stage.
    assert ParallelDims(world_size=4, tp=2, ep=2, etp=1).dp == 2
    assert ParallelDims(world_size=8, tp=2, pp=2, ep=2).dp == 2
    with pytest.raises(ValueError, match=re.escape(
            "world size 4 / pp 1 = 4 ranks per pipeline stage is not divisible by etp*ep = 2*4 = 8")):
        ParallelDims(world_size=4, tp=2, ep=4)
    with pytest.raises(ValueError, match=re.escape(
            "world size 8 / pp 2 = 4 ranks per pipeline stage is not divisible by etp*ep = 1*8 = 8")):
        ParallelDims(world_size=8, pp=2, ep=8, etp=1)
    with pytest.raises(ValueError, match=r"parallel\.etp must be a positive integer or unset, got 0"):
        ParallelDims(world_size=4, ep=2, etp=0)


def test_virtual_pipeline_needs_pipeline():
    assert ParallelDims(world_size=4, pp=2, vpp=2).vpp == 2
    with pytest.raises(ValueError, match=r"parallel\.vpp=2 needs parallel\.pp > 1"):
        ParallelDims(world_size=4, vpp=2)
    with pytest.raises(ValueError, match=r"parallel\.vpp=0 needs parallel\.pp > 1 and vpp >= 1"):
        ParallelDims(world_size=4, pp=2, vpp=0)


def test_groups_need_initialize():
    dims = ParallelDims(world_size=2, tp=2)
    with pytest.raises(RuntimeError, match=r"initialize\(\) must be called"):
        dims.tp_group


@pytest.mark.slow
@pytest.mark.multiprocess
def test_process_groups_four_processes(tmp_path):
    """tp2 x pp2, tp2 x dp2 and ep2 x dp4 on 4 gloo processes: Megatron's rank order tp-cp-ep-dp-pp."""
    out = tmp_path / "groups.json"
    torchrun(4, ["tests/foundation/parallel_dims_worker.py", "--layouts", "2,2,1", "2,1,1", "1,1,2", "--out", str(out)],
             timeout=300)
    results = json.loads(out.read_text())

    # tp2 x pp2 (dp 1): tp ranks consecutive, pipeline stages the slowest coordinate.
    ranks = results["2,2,1"]
    expected = [dict(rank=0, tp=0, pp=0, dp=0, ep=0, etp=0), dict(rank=1, tp=1, pp=0, dp=0, ep=0, etp=1),
                dict(rank=2, tp=0, pp=1, dp=0, ep=0, etp=0), dict(rank=3, tp=1, pp=1, dp=0, ep=0, etp=1)]  # etp = tp
    for rank, r in enumerate(ranks):
        assert r["coordinates"] == expected[rank]
        assert r["all_coordinates"] == expected  # the same table on every rank
        assert r["tp_group"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["pp_stage_ranks"] == [rank % 2, rank % 2 + 2]  # stage 0 first
        assert r["dp_group"] == [rank]
        assert r["mp_group"] == [0, 1, 2, 3]
        assert r["dp"] == 1
        assert (r["is_first_stage"], r["is_last_stage"]) == (rank < 2, rank >= 2)

    # tp2 x dp2 (pp 1): dp groups stride over the tp groups.
    for rank, r in enumerate(results["2,1,1"]):
        assert r["coordinates"] == dict(rank=rank, tp=rank % 2, pp=0, dp=rank // 2, ep=0, etp=rank % 2)
        assert r["tp_group"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["dp_group"] == [rank % 2, rank % 2 + 2]
        assert r["pp_stage_ranks"] == [rank]
        assert r["dp"] == 2 and r["is_first_stage"] and r["is_last_stage"]

    # ep2 (tp 1, dp 4): expert-parallel ranks consecutive; every rank its own pipeline and TP group.
    for rank, r in enumerate(results["1,1,2"]):
        assert r["coordinates"] == dict(rank=rank, tp=0, pp=0, dp=rank, ep=rank % 2, etp=0)
        assert r["ep_group"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["dp_group"] == [0, 1, 2, 3] and r["tp_group"] == [rank]

    assert "built for world size 8 but torch.distributed has 4 processes" in results["wrong_world_error"]
