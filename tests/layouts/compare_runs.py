"""Compare the metrics.jsonl of two runs bitwise, timing and process-size fields aside: the check
that a refactor leaves results unchanged (issue 23: "results under every existing layout stay
bitwise unchanged").

    python tests/layouts/compare_runs.py RUN_DIR_A RUN_DIR_B [RUN_DIR_A2 RUN_DIR_B2 ...]

Run the same config and overrides once on the old code (e.g. `git worktree add /tmp/base <commit>`,
then `PYTHONPATH=/tmp/base` from /tmp/base) and once on the new, then compare the run dirs.
Prints one line per pair; exit status 1 when any pair differs (the first differing field named).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

# Wall-clock and host-process measurements: they differ between any two runs.
VOLATILE_PREFIXES = ("timing_s/",)
VOLATILE_KEYS = ("perf/throughput", "perf/cpu_rss_gb", "perf/rollout_tokens_per_s", "perf/rollout_tokens_per_s_per_gpu",
                 "perf/samples_per_s")


def load(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in VOLATILE_KEYS and not k.startswith(VOLATILE_PREFIXES)} for row in rows]


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    """None when the two metric streams are equal (floats compared exactly), else what differs."""
    if len(a) != len(b):
        return f"{len(a)} rows against {len(b)}"
    for i, (ra, rb) in enumerate(zip(a, b)):
        if ra.keys() != rb.keys():
            return f"row {i}: keys {sorted(ra.keys() ^ rb.keys())} in only one run"
        for key in ra:
            if ra[key] != rb[key]:
                return f"row {i} (step {ra.get('step')}): {key} = {ra[key]!r} against {rb[key]!r}"
    return None


def main(argv: list[str]) -> int:
    if not argv or len(argv) % 2:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    status = 0
    for a, b in zip(argv[::2], argv[1::2]):
        ra, rb = load(a), load(b)
        diff = first_difference(ra, rb)
        fields = len(ra[0]) if ra else 0
        print(f"{a} vs {b}: " + (f"identical ({len(ra)} steps x {fields} fields)" if diff is None else f"DIFFERENT: {diff}"))
        status |= diff is not None
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
