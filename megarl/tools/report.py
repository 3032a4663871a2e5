"""python -m megarl.tools.report RUN_DIR [RUN_DIR ...] --out report.html

Pictures of one run or several side by side, from each run's metrics.jsonl: score (and the
validation score when logged), KL and its coefficient, entropy, losses, grad norms, response
length, each phase's share of the step's time, memory. One PNG per curve beside the HTML (drawn
with matplotlib's Agg backend: no display needed), one column per run in each PNG.
`build_report` returns what was drawn, read back from the figures' lines, so a test can hold the
pictures to the metrics file.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import sys
from pathlib import Path

# (file stem, title, metrics drawn: exact names, or a prefix ending in "/*"). A metric a run never
# logged is left out; a curve with nothing to draw for any run is left out.
CURVES = (
    ("score", "Score", ("critic/score/mean", "val/*")),
    ("kl", "KL", ("actor/reward_kl_penalty", "actor/ppo_kl", "actor/kl_loss")),
    ("kl_coef", "KL coefficient", ("actor/reward_kl_penalty_coeff",)),
    ("entropy", "Entropy", ("actor/entropy",)),
    ("losses", "Losses", ("actor/pg_loss", "critic/vf_loss")),
    ("grad_norms", "Grad norms (before clipping)", ("actor/grad_norm", "critic/grad_norm")),
    ("response_length", "Response length (tokens)", ("response_length/mean",)),
    ("phase_share", "Share of the step's time per phase", ("share:timing_s/*",)),
    ("memory", "Memory (GiB)", ("perf/cpu_rss_gb", "perf/max_memory_allocated_gb", "memory/resident_gb/*")),
)
Series = dict  # {metric: (steps, values)}


def read_records(run_dir: Path) -> list[dict]:
    """The step records of <run_dir>/metrics.jsonl (event lines and cut-short lines left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give run directories (trainer.run_dir) that hold a metrics.jsonl")
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record and "event" not in record:
            records.append(record)
    return records


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def curve_series(records: list[dict], metrics: tuple[str, ...]) -> Series:
    """{metric: (steps, values)} of the metrics a curve draws, as logged (non-finite points skipped).
    `share:timing_s/*` draws each phase's timing_s/<phase> / timing_s/step."""
    names: list[str] = []
    for pattern in metrics:
        bare = pattern.removeprefix("share:")
        found = sorted({k for r in records for k in r if k.startswith(bare[:-1])}) if bare.endswith("/*") else [bare]
        names += [pattern[:len("share:")] + n if pattern.startswith("share:") else n for n in found]
    out: Series = {}
    for name in names:
        steps, values = [], []
        for r in records:
            if name.startswith("share:"):
                phase = name.removeprefix("share:")
                if phase == "timing_s/step" or not (_finite(r.get(phase)) and _finite(r.get("timing_s/step"))):
                    continue
                value = r[phase] / r["timing_s/step"] if r["timing_s/step"] > 0 else None
            else:
                value = r.get(name)
            if _finite(value):
                steps.append(r["step"])
                values.append(float(value))
        if steps:
            out[name.removeprefix("share:")] = (steps, values)
    return out


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Short, distinct names of the runs (the directory name, with its parent where two agree)."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [f"{Path(d).resolve().parent.name}/{n}" if names.count(n) > 1 else n for d, n in zip(run_dirs, names)]


def build_report(run_dirs: list[Path], out: Path) -> dict[str, dict[str, Series]]:
    """Write `out` (HTML) and one PNG per curve beside it; returns {png name: {run label: series}}
    as drawn (each line's data read back from the figure)."""
    # deferred: optional (matplotlib, monitor extra)
    import matplotlib

    matplotlib.use("Agg")
    # deferred: optional (matplotlib, monitor extra)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    labels = run_labels(run_dirs)
    runs = {label: read_records(d) for label, d in zip(labels, run_dirs)}
    drawn: dict[str, dict[str, Series]] = {}
    sections = []
    for stem, title, metrics in CURVES:
        per_run = {label: curve_series(records, metrics) for label, records in runs.items()}
        if not any(per_run.values()):
            continue
        fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.6), sharey=True, squeeze=False)
        png = f"{out.stem}_{stem}.png"
        drawn[png] = {}
        for ax, (label, series) in zip(axes[0], per_run.items()):
            for metric, (steps, values) in series.items():
                ax.plot(steps, values, label=metric, linewidth=1.4)
            ax.set_title(f"{title}: {label}" if len(runs) > 1 else title, fontsize=10)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if series:
                ax.legend(fontsize=7)
            drawn[png][label] = {line.get_label(): ([int(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
                                 for line in ax.get_lines()}
        fig.tight_layout()
        fig.savefig(out.parent / png, dpi=80)
        plt.close(fig)
        sections.append(f'<h2>{html.escape(title)}</h2>\n<img src="{html.escape(png)}" alt="{html.escape(title)}">')
    runs_list = "".join(f"<li>{html.escape(label)}: {html.escape(str(Path(d).resolve()))} ({len(runs[label])} steps)</li>"
                        for label, d in zip(labels, run_dirs))
    out.write_text("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>megarl report</title></head><body>\n"
                   f"<h1>megarl report</h1>\n<ul>{runs_list}</ul>\n" + "\n".join(sections) + "\n</body></html>\n")
    return drawn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="curves of megarl runs from their metrics.jsonl, as HTML + PNGs")
    p.add_argument("run_dirs", nargs="+", type=Path, help="run directories (trainer.run_dir)")
    p.add_argument("--out", type=Path, default=Path("report.html"), help="the HTML file; PNGs go beside it")
    args = p.parse_args(argv)
    try:
        # deferred: optional (matplotlib, monitor extra)
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: megarl.tools.report draws with matplotlib, which is not installed: pip install 'megarl[monitor]'",
              file=sys.stderr)
        return 2
    try:
        drawn = build_report(args.run_dirs, args.out)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} and {len(drawn)} PNGs beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
