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
