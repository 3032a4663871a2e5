"""The step's batch statistics in one reduction (megarl.step.global_batch.LocalStats / GlobalBatch.reduce):
hand-worked values, the same numbers as the one-collective-per-statistic methods, and over two
gloo ranks the same numbers as one rank holding the whole batch."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import spawn
from megarl.step.global_batch import GlobalBatch, LocalStats

SCORES = torch.tensor([1.0, 0.0, 0.5, 0.25])
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [-1.0, -2.0, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def _stats(rows: slice) -> LocalStats:
    stats = LocalStats()
    stats.mean("score", SCORES[rows])
    stats.masked_mean("value", VALUES[rows], MASK[rows])
    stats.sum("tokens", MASK[rows].sum())
    stats.max("score_max", SCORES[rows])
    stats.min("score_min", SCORES[rows])
    return stats


def _one_rank() -> GlobalBatch:
    return GlobalBatch(SimpleNamespace(dp=1, dp_group=None, dp_rank=0))


def test_hand_worked_values_on_one_rank():
    out = _one_rank().reduce(_stats(slice(None)))
    # score mean (1 + 0 + 0.5 + 0.25) / 4 = 0.4375; masked values 1 + 2 + 4 + 7 + 8 + 9 = 31 over 6 tokens
    assert out == {"score": 0.4375, "value": pytest.approx(31 / 6), "tokens": 6.0, "score_max": 1.0, "score_min": 0.0}


def test_reduce_equals_the_single_statistic_methods():
    batch = _one_rank()
    out = batch.reduce(_stats(slice(None)))
    assert out["score"] == batch.mean(SCORES)
    assert out["value"] == batch.masked_mean(VALUES, MASK)
    assert out["tokens"] == batch.sum(MASK.sum())
    assert out["score_max"] == batch.max(SCORES) and out["score_min"] == batch.min(SCORES)


def test_empty_rank_contributes_nothing():
    out = _one_rank().reduce(_stats(slice(0, 0)))
    assert out["score"] == 0.0 and out["tokens"] == 0.0
    assert out["score_max"] == float("-inf") and out["score_min"] == float("inf")


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        batch = GlobalBatch(SimpleNamespace(dp=2, dp_group=None, dp_rank=rank))
        reduced = batch.reduce(_stats(slice(2 * rank, 2 * rank + 2)))
        with open(f"{out_dir}/{rank}.json", "w") as f:
            json.dump(reduced, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_agree_with_one_rank_holding_everything(tmp_path):
    spawn(_two_rank_worker, 2, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 == _one_rank().reduce(_stats(slice(None)))
