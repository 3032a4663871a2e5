"""Print each test tier's measured wall time against its budget (docs/testing.md), from the
runs/test-durations.json that `make test` writes (tests/conftest.py: one entry per MEGARL_TEST_TIER).

    python tests/tier_budgets.py [runs/test-durations.json] [--ci-start EPOCH_SECONDS]

A tier over its budget is printed as such; it does not fail the run (timing is a product figure to
watch, not a test assert). The slowest tests of each tier follow the table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# seconds on the 2-core machine, nothing else running (docs/testing.md, "Budgets"; tests/docs checks the two agree)
BUDGETS = {
    "fast": 180,  # make test-fast
    "full": 2100,  # make test-full: the whole suite on PY's stack
    "core": 300,  # make test-core on the other stack (beside the vLLM tier and the full suite)
    "core-cross": 60,  # the cross-release checkpoint test, in the other direction
    "vllm": 300,  # make test-vllm (beside the core tier and the full suite)
    "image": 120,  # the image check's slow test (resolution against PyPI)
    "ci": 3600,  # the whole .ci/run from a clean clone, installs included (goal: 1800)
}


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def report(data: dict, ci_start: float | None = None, slowest: int = 5) -> list[str]:
    tiers = dict(data.get("tiers", {}))
    rows = [(name, entry["wall_s"], entry) for name, entry in tiers.items()]
    if ci_start:
        rows.append(("ci", time.time() - ci_start, None))
    lines = [f"{'tier':<11} {'measured':>9} {'budget':>9}  tests"]
    for name, wall, entry in rows:
        budget = BUDGETS.get(name)
        mark = "" if budget is None or wall <= budget else "  OVER BUDGET"
        if mark and entry and entry.get("ran_beside"):  # its budget is its time alone; beside, it only had the idle cores
            mark = f"  (ran beside the {entry['ran_beside']} tier: not its time alone)"
        counts = (f"{entry['collected']} collected, {entry['passed']} passed, {entry['failed']} failed, "
                  f"{entry['skipped']} skipped" if entry else "set-up and every tier")
        if entry and entry.get("waited_for_beside_s"):
            counts += f"; of which {_minutes(entry['waited_for_beside_s'])} waiting for the tiers beside it"
        lines.append(f"{name:<11} {_minutes(wall):>9} {_minutes(budget) if budget else '-':>9}  {counts}{mark}")
    for name, entry in tiers.items():
        top = list(entry["tests"].items())[:slowest]
        if top:
            lines.append(f"slowest in {name}: " + "; ".join(f"{t} {s:.0f} s" for t, s in top))
    lines += idle_report(tiers, slowest)
    return lines


def idle_report(tiers: dict, most: int = 5) -> list[str]:
    """Per tier, how busy the machine's cores were (every process's CPU time, background work
    included), and the tests that left the most core-seconds idle: where work beside them would fit."""
    lines = []
    for name, entry in tiers.items():
        if "busy_core_s" not in entry or not entry.get("cores"):
            continue
        cores, wall = entry["cores"], entry["wall_s"]
        lines.append(f"cpu in {name}: {entry['busy_core_s']:.0f} busy core-s of {cores * wall:.0f} "
                     f"({entry['busy_core_s'] / max(cores * wall, 1e-9):.0%}); {cores * wall - entry['busy_core_s']:.0f} idle")
        idle = {t: cores * s - entry["tests_busy_core_s"].get(t, 0.0) for t, s in entry["tests"].items()}
        top = sorted(idle.items(), key=lambda kv: -kv[1])[:most]
        if top:
            lines.append(f"most idle in {name}: " + "; ".join(f"{t} {s:.0f} core-s" for t, s in top))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", nargs="?", type=Path, default=Path("runs/test-durations.json"))
    ap.add_argument("--ci-start", type=float, default=None, help="epoch seconds .ci/run started (its whole time)")
    args = ap.parse_args(argv)
    if not args.path.exists():
        print(f"tier budgets: no {args.path} (run `make test`)")
        return 0
    print("--- test tiers against their budgets (docs/testing.md) ---")
    print("\n".join(report(json.loads(args.path.read_text()), args.ci_start)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
