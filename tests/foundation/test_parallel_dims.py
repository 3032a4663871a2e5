"""ParallelDims: validation with the arithmetic in the message, derived dp, and (4 processes) the
process groups it builds through Megatron's parallel_state."""
from __future__ import annotations

import json
import re

import pytest

from conftest import torchrun
from megarl.distributed.parallel import ParallelDims


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
    with pytest.raises(ValueError, match=r"parallel\.vpp = 2 needs parallel\.pp > 1"):
        ParallelDims(world_size=4, vpp=2)
    with pytest.raises(ValueError, match=r"parallel\.vpp = 0 needs parallel\.pp > 1 and vpp >= 1"):
        ParallelDims(world_size=4, pp=2, vpp=0)


def test_groups_need_initialize():
    dims = ParallelDims(world_size=2, tp=2)
    with pytest.raises(RuntimeError, match=r"initialize\(\) must be called"):
        _ = dims.tp_group


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


def test_uneven_stages_validation():
    dims = ParallelDims(world_size=32, pp=16, first_stage_layers=3, last_stage_layers=2)
    assert dims.stage_layer_counts(61) == [3] + [4] * 14 + [2]
    assert "first_stage_layers=3 last_stage_layers=2" in dims.describe()
    with pytest.raises(ValueError, match=r"parallel\.first_stage_layers = 2 needs parallel\.pp > 1"):
        ParallelDims(world_size=2, first_stage_layers=2)
    with pytest.raises(ValueError, match=r"parallel\.last_stage_layers must be a positive integer or unset, got 0"):
        ParallelDims(world_size=2, pp=2, last_stage_layers=0)
    with pytest.raises(ValueError, match=r"61 layers do not split over pp=16: first stage 3, last stage 3, 55 layers left for 14 stages"):
        ParallelDims(world_size=16, pp=16, first_stage_layers=3, last_stage_layers=3).stage_layer_counts(61)
    with pytest.raises(ValueError, match=r"pipeline stage 0 has 3 layers, not divisible by vpp=2"):
        ParallelDims(world_size=16, pp=16, vpp=2, first_stage_layers=3, last_stage_layers=2).stage_layer_counts(61)
    assert ParallelDims(world_size=2, pp=2, vpp=1).vpp is None  # one virtual stage is plain 1F1B
    with pytest.raises(ValueError, match=r"with vpp=2, pp=2 has no middle stage .* set only one of them"):
        ParallelDims(world_size=2, pp=2, vpp=2, first_stage_layers=2, last_stage_layers=2).stage_layer_counts(4)


@pytest.mark.parametrize("num_layers,pp,vpp,first,last", [
    (8, 2, None, None, None), (8, 2, 2, None, None), (4, 2, None, 1, None), (4, 2, None, None, 1),
    (61, 16, None, 3, 2), (61, 12, None, None, 6), (14, 4, 2, 2, 4), (24, 4, 3, 3, 3), (94, 8, 2, 12, 10)])
def test_chunk_layers_are_megatrons(num_layers, pp, vpp, first, last):
    """ParallelDims.chunk_layers (used to find a layer's owner when exporting) places every layer
    where Megatron-Core builds it (get_transformer_layer_offset / get_num_layers_to_build)."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dims = ParallelDims(world_size=pp, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
                               num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32)
    mine = dims.chunk_layers(num_layers)
    for (rank, vp), layers in mine.items():
        vp_stage = vp if vpp else None
        start = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
        assert layers == range(start, start + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank)), (rank, vp)
    assert sorted(layer for r in mine.values() for layer in r) == list(range(num_layers))
    assert dims.layer_owner(num_layers - 1, num_layers) == (pp - 1, (vpp or 1) - 1)


def test_the_layout_is_built_once_and_its_degrees_are_fixed():
    from megarl.distributed.parallel import ParallelDims

    dims = ParallelDims(world_size=16, tp=2, pp=2, vpp=1)
    assert dims.layout is dims.layout  # held, not rebuilt per read (dims.dp used to rebuild it)
    assert (dims.dp, dims.vpp, dims.layout.tp) == (4, None, 2)  # vpp 1 normalised before the layout was built
    with pytest.raises(AttributeError, match="ParallelDims.tp is fixed once built"):
        dims.tp = 4
    dims.tp = 2  # the same value is no change
    with pytest.raises(ValueError):
        ParallelDims(world_size=6, tp=4)  # the layout arithmetic's own refusal
