"""The benchmark suite (`make bench`) and its regression gate (`make bench-check`).

    python benchmarks/suite.py check [--base REV] [--rounds 30] [--set key=value ...]  # the gate (benchmarks/gate.py)
    python benchmarks/suite.py run   [--out runs/bench/suite.json]       # record the figures below (a few minutes, 2 cores)
    python benchmarks/suite.py compare-record [--results runs/bench/suite.json]   # against the stored record
    python benchmarks/suite.py baseline                                   # refresh this machine kind's record
    (run and baseline take --only ppo,sync,packing,trl: measure some parts; compare-record skips the others,
    baseline keeps the others' figures)

The gate, `check`: this working tree and a base revision (default: the merge base with main) run the PPO
demo in the same run, interleaved step by step; each phase's wall time is compared with a paired bootstrap
interval (benchmarks/gate_stats.py), and a phase more than 10% slower with the interval's lower end above 1
fails, named with its slowdown, interval and commit range. Nothing stored is compared.

The record, `run` (stored per machine kind in benchmarks/baselines/<kind>/suite.json by `baseline`, a record
of machines and dates, not a gate; `compare-record` prints a run against it): every figure is a ratio taken
inside one run:
- `sync/megarl_over_naive`: weight-sync CPU seconds (busiest rank) of megarl's 3D-HybridEngine over
  the naive per-tensor all-gather, alternated in one torchrun (benchmarks/reshard.py, train tp2 ->
  rollout tp1);
- `actor_update/packed_over_padded`: CPU seconds of a packed over a padded actor update, alternated
  in one process (benchmarks/packing.py);
- `ppo/<phase>`: median CPU seconds of each PPO phase of the CPU demo (one process) over the CPU
  seconds of a fixed calibration workload run in the same process before and after every step
  (benchmarks/_ppo_probe.py). CPU time, not wall time: on a shared machine wall time mostly
  measures the neighbours;
- `rollout/<engine>/seconds_per_token`: generation CPU seconds per generated token, over the same
  calibration, for each rollout engine installed and usable here (HF always; vLLM/SGLang need a GPU);
- `ppo/update_actor_per_optimizer_step`: the actor update's figure over its optimizer steps (epochs
  x mini-batches): the fixed cost per optimizer step;
- `vs_trl/megarl_over_trl`: megarl's median GRPO-step CPU seconds over TRL's GRPOTrainer's on the same
  work, alternated (benchmarks/vs_trl.py; TRL in runs/trl-venv, made on first use; BENCH_TRL=0 skips it).
Lower is better for all. `compare-record` lists each figure more than --tolerance (15%; the sync figure
carries 30%, its measured noise) above the record; it exits 0 (2 when a file is missing).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate  # noqa: E402
import gate_stats  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "runs" / "bench" / "suite.json"
DEFAULT_CHECK_RESULTS = REPO / "runs" / "bench" / "check.json"
WARMUP_STEPS = 2
GATE_MIN_SHARE = 0.05


def machine_kind() -> str:
    """`cpu-<cores>` or the GPU's name, as a directory name (baselines are per machine kind)."""
    try:
        import torch

        if torch.cuda.is_available():
            return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    except ImportError:
        pass
    return f"cpu-{os.cpu_count()}"


def baseline_path(kind: str | None = None) -> Path:
    return REPO / "benchmarks" / "baselines" / (kind or machine_kind()) / "suite.json"


def _run(cmd: list[str], env: dict | None = None) -> None:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                              "PYTHONWARNINGS": "ignore", **(env or {})})
    if proc.returncode:
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-4000:]}")


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def bench_sync(tmp: Path) -> dict:
    out = tmp / "reshard.json"
    _run(_torchrun(2) + ["benchmarks/reshard.py", "--train-tp", "2", "--rollout-tp", "1", "--num-layers", "24", "--repeats", "12",
                         "--clock", "cpu", "--out", str(out)])
    r = json.loads(out.read_text())
    # Fastest over fastest, after two warm-up repeats: interference from other processes only
    # adds time, so the minima are the steadiest estimate of each method's cost. Still the
    # noisiest figure here (two gloo ranks on two shared cores: 0.67-0.84 over four runs of the
    # same code), hence its own tolerance.
    megarl, naive = r["megarl"]["seconds_all"][2:], r["naive"]["seconds_all"][2:]
    return {"sync/megarl_over_naive": {"value": min(megarl) / min(naive), "gate": True, "tolerance": 0.30,
                                       "detail": {"megarl_s": r["megarl"]["seconds_all"], "naive_s": r["naive"]["seconds_all"]}}}


def bench_packing(tmp: Path) -> dict:
    out = tmp / "packing.json"
    _run([sys.executable, "benchmarks/packing.py", "--sequences", "16", "--rounds", "3", "--clock", "cpu",
          "--out", str(out)])
    r = json.loads(out.read_text())
    return {"actor_update/packed_over_padded": {"value": 1.0 / r["speedup_packed_over_padded"], "gate": True,
                                                "detail": r["median_seconds_per_step"]}}


BENCH_DATA = REPO / "runs" / "bench" / "arithmetic"


def prepare_bench_data() -> None:
    """The suite's own copy of the demo's data, written when missing (a fresh clone has none).

    The launch cannot write it: `data.auto_prepare` writes only the config file's own paths, never a
    path given on the command line (a typo there must not train on synthetic data).
    """
    if (BENCH_DATA / "train.parquet").is_file() and (BENCH_DATA / "test.parquet").is_file():
        return
    import yaml

    from megarl.data.prepare import prepare_arithmetic

    a = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())["data"]["arithmetic"]
    prepare_arithmetic(BENCH_DATA, a["kind"], a["num_digits"], a["train_size"], a["val_size"])


def bench_ppo(tmp: Path, steps: int) -> dict:
    run_dir = tmp / "ppo"
    prepare_bench_data()
    overrides = [f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", "trainer.save_every_steps=0",
                 f"trainer.val_every_steps={steps + 1}", "tracking.progress_bar=false", "tracking.mlflow=false",
                 f"model.path={REPO / 'runs' / 'bench' / 'tiny-llama-digits'}",
                 f"data.train_files=[{BENCH_DATA / 'train.parquet'}]", f"data.val_files=[{BENCH_DATA / 'test.parquet'}]"]
    _run([sys.executable, "benchmarks/_ppo_probe.py", "--config", "configs/tiny_cpu.yaml", *overrides])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r][WARMUP_STEPS:]
    phases = sorted(k.removeprefix("bench/cpu_s/") for k in rows[0] if k.startswith("bench/cpu_s/"))
    out = {}
    step = statistics.median(sum(r[f"bench/cpu_s/{ph}"] for ph in phases) for r in rows)
    for ph in phases:
        seconds = statistics.median(r[f"bench/cpu_s/{ph}"] for r in rows)
        out[f"ppo/{ph}"] = {"value": statistics.median(r[f"bench/cpu_s/{ph}"] / r["bench/calibration_cpu_s"] for r in rows),
                            "gate": seconds >= GATE_MIN_SHARE * step,
                            "detail": {"median_cpu_s": seconds, "share_of_step": seconds / step,
                                       "median_wall_s": statistics.median(r[f"timing_s/{ph}"] for r in rows)}}
    # The HF engine's generation speed: CPU time of the gen phase per generated token.
    per_token = [r["bench/cpu_s/gen"] / (r["response_length/mean"] * _responses(rows)) / r["bench/calibration_cpu_s"] for r in rows]
    out["rollout/hf/seconds_per_token"] = {"value": statistics.median(per_token), "gate": out["ppo/gen"]["gate"]}
    out["_calibration_cpu_s"] = {"value": statistics.median(r["bench/calibration_cpu_s"] for r in rows), "gate": False}
    # The fixed cost per optimizer step (issue 28): the actor update over its epochs x mini-batches.
    steps = _optimizer_steps()
    out["ppo/update_actor_per_optimizer_step"] = {"value": out["ppo/update_actor"]["value"] / steps, "gate": out["ppo/update_actor"]["gate"],
                                                  "detail": {"median_cpu_s": out["ppo/update_actor"]["detail"]["median_cpu_s"] / steps,
                                                             "optimizer_steps": steps}}
    return out


def _optimizer_steps() -> int:
    import yaml

    actor = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())["actor"]
    return actor["ppo_epochs"] * actor["ppo_mini_batches"]


TRL_FIGURE = "vs_trl/megarl_over_trl"


def bench_vs_trl(tmp: Path) -> dict:
    """megarl's GRPO step over TRL's on the same work (benchmarks/vs_trl.py: one alternating round; TRL
    in its own venv, made on first use). Two runs of the same code read 0.9x-1.2x apart on this shared
    machine, hence its own 30% tolerance."""
    out = tmp / "vs_trl.json"
    _run([sys.executable, "benchmarks/vs_trl.py", "--rounds", "1", "--steps", "4", "--out", str(out)])
    r = json.loads(out.read_text())
    return {TRL_FIGURE: {"value": r["ratio_megarl_over_trl_cpu"], "gate": True, "tolerance": 0.30,
                         "detail": {"per_optimizer_step_cpu_s": r["per_optimizer_step_cpu_s"], "median_step_s": r["median_step_s"]}}}


def _responses(rows) -> int:
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    return cfg["data"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"]


def other_engines() -> dict:
    """vLLM / SGLang: measured where installed with a GPU; otherwise the reason they are not."""
    out = {}
    for engine in ("vllm", "sglang"):
        if importlib.util.find_spec(engine) is None:
            out[f"rollout/{engine}"] = {"skipped": f"{engine} is not installed"}
        else:
            out[f"rollout/{engine}"] = {"skipped": f"{engine} is installed but the suite does not measure it yet (needs a GPU run)"}
    return out


# The suite's parts (`run --only`) and the figure names each one measures.
PARTS = {"ppo": ("ppo/", "rollout/hf/"), "sync": ("sync/",), "packing": ("actor_update/",), "trl": ("vs_trl/",)}


def run_suite(out: Path, steps: int, only: tuple[str, ...] = tuple(PARTS)) -> dict:
    # BENCH_TRL=0 skips the TRL comparison (it installs TRL into runs/trl-venv on first use); check
    # then reports it as skipped, not as missing. So are the parts `run --only` leaves out.
    skipped_parts = {p: "run --only" for p in PARTS if p not in only}
    if "trl" in only and os.environ.get("BENCH_TRL", "1") == "0":
        skipped_parts["trl"] = "BENCH_TRL=0"
    parts = [p for p in PARTS if p not in skipped_parts]
    skipped = [TRL_FIGURE] if "trl" in skipped_parts else []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        metrics = {}
        for part, bench in (("ppo", lambda: bench_ppo(tmp, steps)), ("sync", lambda: bench_sync(tmp)),
                            ("packing", lambda: bench_packing(tmp)), ("trl", lambda: bench_vs_trl(tmp))):
            if part in parts:
                metrics.update(bench())
    result = {"machine_kind": machine_kind(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
              "load_average_1_5_15": list(os.getloadavg()), "injected": os.environ.get("MEGARL_BENCH_INJECT"),
              "metrics": metrics, "skipped": skipped, "skipped_parts": skipped_parts,
              "not_measured": other_engines()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def compare(current: dict, baseline: dict, tolerance: float) -> tuple[list[str], list[str]]:
    """(report lines, regressions): every gated baseline figure must be present and at most
    (1 + tolerance) x its baseline value."""
    lines, regressions = [], []
    for name, base in sorted(baseline["metrics"].items()):
        if name.startswith("_"):
            continue
        now = current["metrics"].get(name)
        left_out = [why for p, why in current.get("skipped_parts", {}).items() if name.startswith(PARTS[p])]
        if now is None and (name in current.get("skipped", ()) or left_out):
            lines.append(f"{'skipped':>18}  {name:<36} (skipped on request: {(left_out or ['BENCH_TRL=0'])[0]})")
            continue
        if now is None:
            regressions.append(f"{name}: measured in the baseline, missing now")
            continue
        ratio = now["value"] / base["value"]
        gated = base.get("gate", False)
        tol = base.get("tolerance", tolerance)  # a figure may carry its own, measured noise
        verdict = "ok" if ratio <= 1 + tol else ("REGRESSION" if gated else "slower (not gated)")
        lines.append(f"{verdict:>18}  {name:<36} {now['value']:10.4f} vs baseline {base['value']:10.4f}  ({ratio:.2f}x)")
        if gated and ratio > 1 + tol:
            what = f"PPO phase '{name.removeprefix('ppo/')}'" if name.startswith("ppo/") else name
            regressions.append(f"{what}: {ratio:.2f}x its baseline ({now['value']:.4f} vs {base['value']:.4f}; tolerance {tol:.0%})")
    return lines, regressions


def merge_baseline(old: dict, new: dict, parts: tuple[str, ...]) -> dict:
    """`baseline --only`: the new run's figures for the re-measured parts, the old baseline's for the
    others. A re-measured part's old figures all go (a phase the demo no longer runs must not stay)."""
    def remeasured(name: str) -> bool:
        return ("ppo" in parts) if name.startswith("_") else any(name.startswith(PARTS[p]) for p in parts)

    kept = {k: v for k, v in old["metrics"].items() if not remeasured(k)}
    return {**new, "metrics": {**kept, **new["metrics"]}, "remeasured_parts": list(parts), "skipped_parts": {}, "skipped": []}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure the suite")
    r.add_argument("--out", type=Path, default=DEFAULT_RESULTS)
    r.add_argument("--steps", type=int, default=10, help=f"PPO steps (the first {WARMUP_STEPS} are warm-up)")
    r.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to measure, of {','.join(PARTS)} "
                   "(check then reports the others as skipped)")
    c = sub.add_parser("check", help="the regression gate: the candidate against a base revision, measured in the same run")
    c.add_argument("--base", help="base revision (default: the merge base with main, else the last bench-baseline* tag)")
    c.add_argument("--base-dir", type=Path, help="a base checkout exported beforehand, where there is no history "
                   "(git archive REV | tar -x -C DIR)")
    c.add_argument("--rounds", type=int, default=gate.DEFAULT_ROUNDS, help="paired rounds (one step of each side)")
    c.add_argument("--max-rounds", type=int, help="rounds at most, added --rounds at a time while a phase is "
                   "inconclusive (its interval reaches above the tolerance); default 3 x --rounds")
    c.add_argument("--warmup", type=int, default=gate.DEFAULT_WARMUP, help="unrecorded rounds first")
    c.add_argument("--config", default=gate.DEFAULT_CONFIG, help="the PPO run measured (relative to the repository)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for both sides (repeatable)")
    c.add_argument("--tolerance", type=float, default=gate_stats.DEFAULT_TOLERANCE,
                   help="a slowdown above this (and above 1 at the interval's lower end) fails")
    c.add_argument("--confidence", type=float, default=gate_stats.DEFAULT_CONFIDENCE)
    c.add_argument("--min-seconds", type=float, default=gate_stats.DEFAULT_MIN_SECONDS,
                   help="phases whose base median is shorter are reported, not gated")
    c.add_argument("--out", type=Path, default=DEFAULT_CHECK_RESULTS)
    r2 = sub.add_parser("compare-record", help="compare suite results with a stored baseline (a record, not a gate)")
    r2.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    r2.add_argument("--baseline", type=Path)
    r2.add_argument("--tolerance", type=float, default=0.15)
    b = sub.add_parser("baseline", help="measure and store as this machine kind's baseline")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--only", help="comma-separated parts to re-measure; the baseline's other figures are kept")
    args = p.parse_args(argv)

    if args.cmd == "run":
        only = tuple(p.strip() for p in args.only.split(",") if p.strip())
        unknown = sorted(set(only) - set(PARTS))
        if unknown or not only:
            print(f"error: --only {args.only!r}: unknown part(s) {unknown}; choose from {','.join(PARTS)}", file=sys.stderr)
            return 2
        result = run_suite(args.out, args.steps, only)
        for name, m in result["metrics"].items():
            print(f"{name:<36} {m['value']:.4f}{'' if m['gate'] else '  (not gated)'}")
        print(f"wrote {args.out}")
        return 0
    if args.cmd == "baseline":
        if os.environ.get("MEGARL_BENCH_INJECT"):
            print("error: MEGARL_BENCH_INJECT is set; a baseline must measure the code as it is (unset it)", file=sys.stderr)
            return 2
        out = baseline_path()
        only = tuple(p.strip() for p in (args.only or ",".join(PARTS)).split(",") if p.strip())
        if set(only) - set(PARTS) or (args.only and not out.is_file()):
            print(f"error: --only {args.only!r}: choose parts from {','.join(PARTS)}, with an existing baseline ({out})", file=sys.stderr)
            return 2
        old = json.loads(out.read_text()) if args.only else None
        result = run_suite(out, args.steps, only)
        if old is not None:
            out.write_text(json.dumps(merge_baseline(old, result, only), indent=1) + "\n")
        print(f"wrote {out}; commit it with a message saying why the baseline moved")
        return 0
    if args.cmd == "check":
        return gate.check(args.base, args.rounds, args.max_rounds or 3 * args.rounds, args.warmup, args.config, args.set, args.tolerance, args.confidence,
                          args.min_seconds, args.out, prepare=prepare_bench_data,
                          base_dir=args.base_dir)
    return compare_record(args.results, args.baseline, args.tolerance)


def compare_record(results: Path, baseline: Path | None, tolerance: float) -> int:
    """`compare-record`: the stored baseline's figures against a `run`'s, printed; a record, so it always
    exits 0 when both files exist (the gate is `check`)."""
    if not results.is_file():
        print(f"error: {results} does not exist; run `make bench` (python benchmarks/suite.py run) first", file=sys.stderr)
        return 2
    current = json.loads(results.read_text())
    base_file = baseline or baseline_path(current["machine_kind"])
    if not base_file.is_file():
        print(f"error: no baseline for machine kind {current['machine_kind']!r} ({base_file}); create one with "
              f"`python benchmarks/suite.py baseline` (see benchmarks/README.md)", file=sys.stderr)
        return 2
    lines, slower = compare(current, json.loads(base_file.read_text()), tolerance)
    print(f"compare-record: {results} against {base_file.relative_to(REPO) if base_file.is_relative_to(REPO) else base_file} "
          "(a record of machines and dates; the gate is `suite.py check`)")
    print("\n".join(lines))
    for line in slower:
        print(f"slower than the record: {line}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
