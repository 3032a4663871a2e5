"""The persistent test worlds (tests/worlds.py): many jobs per world, output and exit codes as torchrun's,
and a world whose job failed or hung is stopped and started fresh before the next job."""
from __future__ import annotations

import pytest

import worlds

pytestmark = pytest.mark.multiprocess
JOBS = "foundation.world_jobs"


@pytest.fixture
def world2():
    if not worlds.enabled():
        pytest.skip("MEGARL_TEST_WORLDS=0")
    return worlds.world(2)


def test_jobs_share_a_world_and_its_group(world2):
    first = world2.call(f"{JOBS}:rank_and_pid")
    assert [rank for rank, _ in first] == [0, 1]
    assert world2.call(f"{JOBS}:all_reduce_rank") == [1, 1]
    assert world2.call(f"{JOBS}:rank_and_pid") == first  # the same processes: nothing started again


def test_a_failed_job_is_named_and_the_next_job_gets_a_fresh_world(world2):
    before = world2.call(f"{JOBS}:rank_and_pid")
    with pytest.raises(worlds.WorldFailed, match=r"(?s)rank 1 fails on purpose"):
        world2.call(f"{JOBS}:print_and_fail_on", 1)
    after = world2.call(f"{JOBS}:rank_and_pid")
    assert {pid for _, pid in after}.isdisjoint(pid for _, pid in before)
    assert world2.call(f"{JOBS}:all_reduce_rank") == [1, 1]


def test_output_and_exit_codes_are_torchruns(world2):
    proc = world2.script(["-m", "foundation.world_exit", "3"])
    assert proc.returncode == 1  # torchrun's code when a worker fails
    ok = world2.script(["-m", "foundation.world_exit", "0"])
    assert ok.returncode == 0 and ok.stdout.count("exiting with 0") == 2, ok.stdout
    one = worlds.world(1).script(["-m", "foundation.world_exit", "2"])
    assert one.returncode == 2 and "exiting with 2" in one.stdout  # a world of one: the code itself, as `python`


def test_a_job_that_ends_the_default_group_leaves_a_world_that_works(world2):
    world2.call(f"{JOBS}:end_the_default_group")
    assert world2.call(f"{JOBS}:all_reduce_rank") == [1, 1]


def test_a_world_whose_ranks_a_job_left_overgrown_is_started_fresh(world2):
    before = world2.call(f"{JOBS}:rank_and_pid")
    world2.call(f"{JOBS}:leave_threads", 10)  # a few: the world goes on
    assert world2.call(f"{JOBS}:rank_and_pid") == before
    world2.call(f"{JOBS}:leave_threads", worlds.MAX_RANK_THREADS)  # past the bound: the next job gets new ranks
    after = world2.call(f"{JOBS}:rank_and_pid")
    assert [rank for rank, _ in after] == [0, 1]
    assert not {pid for _, pid in after} & {pid for _, pid in before}
    assert max(world2.threads()) <= worlds.MAX_RANK_THREADS


def test_a_hung_job_is_stopped_at_its_timeout_naming_the_rank(world2):
    before = world2.call(f"{JOBS}:rank_and_pid")
    with pytest.raises(worlds.WorldFailed, match=r"rank 0 did not finish within 5 s"):
        world2.call(f"{JOBS}:hang_on", 0, timeout=5)
    after = world2.call(f"{JOBS}:rank_and_pid")
    assert {pid for _, pid in after}.isdisjoint(pid for _, pid in before)


def test_a_script_that_makes_its_own_group_runs_after_a_job_that_used_the_worlds(world2):
    assert world2.call(f"{JOBS}:all_reduce_rank") == [1, 1]  # the world's group is up
    proc = world2.script(["tests/foundation/world_own_group.py"])
    assert proc.returncode == 0 and proc.stdout.count("sum 3 over 2 ranks") == 2, proc.stdout + proc.stderr
    assert world2.call(f"{JOBS}:all_reduce_rank") == [1, 1]  # and the world's group is made again after it
