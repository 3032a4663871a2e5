"""docs/testing.md states each test tier's budget; tests/tier_budgets.py prints `make test`'s tiers
against the same numbers."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_budgets_in_the_docs_are_the_ones_make_test_prints():
    spec = importlib.util.spec_from_file_location("tier_budgets", REPO / "tests" / "tier_budgets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (REPO / "docs" / "testing.md").read_text()
    section = text.split("## Budgets", 1)[1].split("\n## ", 1)[0]
    documented = {name: int(seconds) for name, seconds in re.findall(r"^\| ([a-z-]+) \| (\d+) \|$", section, re.M)}
    assert documented == module.BUDGETS


def test_the_tier_report_marks_a_tier_over_its_budget():
    spec = importlib.util.spec_from_file_location("tier_budgets", REPO / "tests" / "tier_budgets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    entry = dict(wall_s=200.0, collected=3, passed=2, failed=1, skipped=0, tests={"t::a": 150.0, "t::b": 50.0})
    lines = module.report({"tiers": {"fast": entry, "core": dict(entry, wall_s=100.0)}})
    fast = next(line for line in lines if line.startswith("fast "))
    core = next(line for line in lines if line.startswith("core "))
    assert "3:20" in fast and "3:00" in fast and "OVER BUDGET" in fast
    assert "1:40" in core and "OVER BUDGET" not in core
    assert any(line.startswith("slowest in fast: t::a 150 s; t::b 50 s") for line in lines)


def test_the_tier_report_says_which_tiers_ran_beside_the_full_one_and_how_long_it_waited_for_them():
    spec = importlib.util.spec_from_file_location("tier_budgets", REPO / "tests" / "tier_budgets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    entry = dict(wall_s=400.0, collected=1, passed=1, failed=0, skipped=0, tests={"t::a": 150.0})
    lines = module.report({"tiers": {"full": dict(entry, wall_s=2000.0, waited_for_beside_s=95.0),
                                     "core": dict(entry, ran_beside="full"), "vllm": entry}})
    full, core, vllm = (next(line for line in lines if line.startswith(name + " ")) for name in ("full", "core", "vllm"))
    assert "of which 1:35 waiting for the tiers beside it" in full and "OVER BUDGET" not in full
    assert "6:40" in core and "OVER BUDGET" not in core and "(ran beside the full tier: not its time alone)" in core
    assert "OVER BUDGET" in vllm  # run alone, its budget holds


def test_the_tier_report_says_how_busy_the_cores_were_and_which_tests_left_them_idle():
    spec = importlib.util.spec_from_file_location("tier_budgets", REPO / "tests" / "tier_budgets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # 2 cores for 100 s = 200 core-s, 150 of them busy; t::a ran 60 s with 30 busy core-s (90 idle),
    # t::b 40 s with 38 (42 idle)
    entry = dict(wall_s=100.0, collected=2, passed=2, failed=0, skipped=0, tests={"t::a": 60.0, "t::b": 40.0},
                 cores=2, busy_core_s=150.0, tests_busy_core_s={"t::a": 30.0, "t::b": 38.0})
    lines = module.report({"tiers": {"full": entry}})
    assert "cpu in full: 150 busy core-s of 200 (75%); 50 idle" in lines
    assert "most idle in full: t::a 90 core-s; t::b 42 core-s" in lines


def test_make_tests_first_paths_run_first_in_their_collected_order():
    import conftest

    class Item:
        def __init__(self, path):
            self.fspath = REPO / path

    items = [Item(p) for p in ("tests/a/test_1.py", "tests/multinode/test_2.py", "tests/b/test_3.py",
                               "tests/multinode/test_4.py", "tests/c/test_5.py")]
    conftest._run_first(items, "tests/multinode, tests/c/")
    assert [str(i.fspath.relative_to(REPO)) for i in items] == [
        "tests/multinode/test_2.py", "tests/multinode/test_4.py", "tests/c/test_5.py", "tests/a/test_1.py", "tests/b/test_3.py"]
    conftest._run_first(items, "")  # unset: the order stays
    assert str(items[0].fspath.relative_to(REPO)) == "tests/multinode/test_2.py"


def test_make_tests_last_paths_run_after_everything_else():
    import conftest

    class Item:
        def __init__(self, path):
            self.fspath = REPO / path

    items = [Item(p) for p in ("tests/benchmarks/test_bench_gate.py", "tests/multinode/test_2.py", "tests/a/test_1.py")]
    conftest._run_first(items, "tests/multinode", "tests/benchmarks/test_bench_gate.py")
    assert [str(i.fspath.relative_to(REPO)) for i in items] == [
        "tests/multinode/test_2.py", "tests/a/test_1.py", "tests/benchmarks/test_bench_gate.py"]


def test_the_last_tests_wait_for_the_tiers_beside_the_full_one(monkeypatch):
    import subprocess
    import time

    import conftest

    class Item:
        def __init__(self, path):
            self.fspath, self.nodeid = REPO / path, path + "::t"

    beside = subprocess.Popen(["sleep", "1.5"])  # ends as a zombie (unreaped): ended all the same
    monkeypatch.setenv("MEGARL_TEST_LAST", "tests/benchmarks/test_bench_gate.py")
    monkeypatch.setenv("MEGARL_TEST_LAST_WAITS_FOR", str(beside.pid))
    monkeypatch.setattr(conftest, "_WAITED_FOR_BESIDE", [])
    said: list[str] = []
    try:
        assert conftest.wait_before_the_last_tests(Item("tests/a/test_1.py"), say=said.append, poll_s=0.1) == 0.0
        assert conftest.process_running(beside.pid) and not said  # not a last test: nothing waited
        start = time.monotonic()
        waited = conftest.wait_before_the_last_tests(Item("tests/benchmarks/test_bench_gate.py"), say=said.append, poll_s=0.1)
        assert 1.0 < waited <= time.monotonic() - start and not conftest.process_running(beside.pid)
        assert beside.poll() == 0 and len(said) == 2 and str(beside.pid) in said[0] and "ended" in said[1]
        # once per session: the next last test does not wait again
        assert conftest.wait_before_the_last_tests(Item("tests/benchmarks/test_bench_gate.py"), say=said.append) == 0.0
        assert len(said) == 2
    finally:
        beside.kill()
        beside.wait()
