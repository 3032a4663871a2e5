"""Atomic checkpoint directories (megarl.checkpointing.checkpoint_io)."""
from __future__ import annotations

import threading

import pytest

from megarl.checkpointing.checkpoint_io import (COMPLETE, atomic_dir, checkpoint_step, cleanup_old_checkpoints,
                                  complete_checkpoints, latest_complete_checkpoint, remove_leftovers, step_dir)


def _save(run_dir, step, payload="weights"):
    with atomic_dir(step_dir(run_dir, step)) as tmp:
        (tmp / "model.bin").write_text(payload)


def test_a_save_appears_complete_and_is_found(tmp_path):
    assert latest_complete_checkpoint(tmp_path) is None
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    latest = latest_complete_checkpoint(tmp_path)
    assert latest == tmp_path / "step_00000020" and checkpoint_step(latest) == 20
    assert (latest / COMPLETE).is_file() and (latest / "model.bin").read_text() == "weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010", "step_00000020"]


def test_a_crash_mid_write_leaves_the_old_checkpoint(tmp_path):
    _save(tmp_path, 10, "good")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_dir(step_dir(tmp_path, 20)) as tmp:
            (tmp / "model.bin").write_text("half")
            raise RuntimeError("disk full")
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "step_00000010"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010"]  # temp dir removed


def test_a_killed_process_leaves_only_an_ignored_temp_dir(tmp_path):
    _save(tmp_path, 10)
    # What a SIGKILL mid-write leaves: a temp dir, and a final-named dir without its marker.
    (tmp_path / "step_00000020.tmp-dead").mkdir()
    (tmp_path / "step_00000030").mkdir()
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "step_00000010"
    assert [p.name for p in remove_leftovers(tmp_path)] == ["step_00000020.tmp-dead"]
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "step_00000010"


def test_resaving_a_step_replaces_it_only_on_success(tmp_path):
    _save(tmp_path, 10, "v1")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(step_dir(tmp_path, 10)) as tmp:
            (tmp / "model.bin").write_text("partial")
            raise KeyboardInterrupt
    assert (step_dir(tmp_path, 10) / "model.bin").read_text() == "v1"
    _save(tmp_path, 10, "v2")
    assert (step_dir(tmp_path, 10) / "model.bin").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000010"]


def test_keep_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    assert cleanup_old_checkpoints(tmp_path, keep_last=0) == []
    removed = cleanup_old_checkpoints(tmp_path, keep_last=2)
    assert [checkpoint_step(p) for p in removed] == [1, 2]
    assert [checkpoint_step(p) for p in complete_checkpoints(tmp_path)] == [3, 4]


def test_several_ranks_write_one_checkpoint(tmp_path):
    """Rank 0 creates the temp dir, every rank writes, rank 0 commits: with threads as ranks."""
    world = 3
    barrier = threading.Barrier(world)
    seen_complete_inside = []

    def rank_main(rank):
        with atomic_dir(step_dir(tmp_path, 5), rank=rank, barrier=barrier.wait, token="s5") as tmp:
            (tmp / f"shard_{rank}.bin").write_text(str(rank))
            seen_complete_inside.append((tmp / COMPLETE).exists())

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    final = latest_complete_checkpoint(tmp_path)
    assert final == step_dir(tmp_path, 5)
    assert sorted(p.name for p in final.iterdir()) == [COMPLETE, "shard_0.bin", "shard_1.bin", "shard_2.bin"]
    assert seen_complete_inside == [False] * world


def test_multi_rank_save_clears_a_leftover_with_the_same_token(tmp_path):
    stale = tmp_path / "step_00000005.tmp-s5"
    stale.mkdir()
    (stale / "shard_9.bin").write_text("stale")
    with atomic_dir(step_dir(tmp_path, 5), rank=0, barrier=lambda: None, token="s5") as tmp:
        (tmp / "shard_0.bin").write_text("0")
    assert sorted(p.name for p in step_dir(tmp_path, 5).iterdir()) == [COMPLETE, "shard_0.bin"]
