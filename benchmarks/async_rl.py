"""Separate placement, the asynchronous schedule and the rollout fleet against colocated, on the same cores.

    python benchmarks/async_rl.py --out benchmarks/results/async_rl_cpu.json [--steps 8] [key=value ...]

One launch of each mode per round of the CPU demo (configs/tiny_cpu.yaml) on 2 processes with fixed-length
responses (rollout.ignore_eos): colocated-sync (DP 2, the ranks take turns), separate-sync (1
training + 1 rollout rank, K = 0), separate-async (K = 1, 2) and the fleet (rollout.placement=fleet: one
training process and 1 or 2 rollout servers, each process one thread as each torchrun rank is). Writes samples/s of each (responses
over the summed step times after the warm-up step), the ratios separate_async_over_separate_sync and
separate_async_over_colocated_sync (the best K), each group's idle fraction (trainer: time waiting
for samples; rollout rank: 1 - generating time over the steps' time; colocated ranks do both phases
in turn, so the rollout phase's share of the step is reported for them), and the staleness seen.
fleet_1_over_separate_sync and fleet_2_over_separate_sync compare the fleet with the placement it
replaces (both synchronous; at 2 servers on 2 cores generation has both cores while training waits);
fleet_1_k1 and fleet_2_k1 are the same fleets at async.max_staleness=1, compared with separate-async
at K = 1 and with the synchronous fleet of as many servers.
The defaults make generation and training cost about the same on the split ranks: separate-sync's
`busy_s_per_step` (the training rank's step less its wait for samples; the rollout rank's generating
seconds) are in the result so that balance can be checked (at balance the overlap can at most halve
the step: separate-async over separate-sync <= 2; with generation g and training t it is
(g + t) / max(g, t)).

Other sessions share the machine's cores: the modes run in --repeats rounds, each round every mode
once (the order rotated from round to round), each launch's load average recorded; a mode's figure
is its median over the rounds and each ratio the median of the rounds' ratios (a round's modes ran
close together in time, so its ratio sees the least drift in load).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result  # benchmarks/_common.py

REPO = Path(__file__).resolve().parents[1]
# fixed-length responses of 32 tokens, 2 update epochs: generation and training about equal on a
# quiet 2-core machine (separate-sync, 2026-12-06: generating 0.27-0.29 s a step, updating 0.29-0.32 s).
# The earlier geometry (12 tokens, 3 epochs) was balanced on a loaded machine (2026-12-02, load 17-58)
# but quiet its generation was a third of the training, which leaves asynchrony little to hide
DEFAULTS = {"rollout.ignore_eos": "true", "rollout.max_new_tokens": 32, "data.prompts_per_step": 16,
            "rollout.samples_per_prompt": 8, "actor.ppo_epochs": 2, "actor.ppo_mini_batches": 2,
            "rollout.verify_weights": "false", "tracking.loggers": "[console,jsonl]", "tracking.progress_bar": "false",
            "trainer.save_every_steps": 0, "trainer.val_every_steps": 0}
MODES = {"colocated_sync": {},
         "separate_sync": {"rollout.placement": "separate", "rollout.num_ranks": 1},
         "separate_async_k1": {"rollout.placement": "separate", "rollout.num_ranks": 1, "async.max_staleness": 1},
         "separate_async_k2": {"rollout.placement": "separate", "rollout.num_ranks": 1, "async.max_staleness": 2},
         # one training process and 1 or 2 rollout servers (python -m megarl.rollout.serve) joined to it
         "fleet_1": {"rollout.placement": "fleet", "rollout.fleet.min_servers": 1},
         "fleet_2": {"rollout.placement": "fleet", "rollout.fleet.min_servers": 2},
         # the same fleets at K = 1: the servers generate step t + 1 while the trainer trains step t
         "fleet_1_k1": {"rollout.placement": "fleet", "rollout.fleet.min_servers": 1, "async.max_staleness": 1},
         "fleet_2_k1": {"rollout.placement": "fleet", "rollout.fleet.min_servers": 2, "async.max_staleness": 1}}
FLEET_SERVERS = {mode: o["rollout.fleet.min_servers"] for mode, o in MODES.items() if o.get("rollout.placement") == "fleet"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, cmd: list[str], run_dir: Path, env: dict, address: str = "") -> None:
    """The trainer's launch to its end; under a fleet mode its servers beside it, joined with the token
    the trainer writes, each one process of one thread (as each rank of the torchrun modes is)."""
    if mode not in FLEET_SERVERS:
        subprocess.run(cmd, cwd=REPO, check=True, env=env, stdout=subprocess.DEVNULL)
        return
    env = {**env, "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    token, servers = run_dir / "fleet.token", []
    try:
        while not (token.is_file() and token.read_text().strip()):
            if trainer.poll() is not None:
                raise subprocess.CalledProcessError(trainer.returncode, cmd)
            time.sleep(0.1)
        servers = [subprocess.Popen([sys.executable, "-m", "megarl.rollout.serve", "--trainer", address,
                                     "--token-file", str(token), "--server-id", f"s{k}"],
                                    cwd=REPO, env=env, stdout=subprocess.DEVNULL)
                   for k in range(FLEET_SERVERS[mode])]
        if trainer.wait() != 0:
            raise subprocess.CalledProcessError(trainer.returncode, cmd)
        for server in servers:
            server.wait(timeout=60)  # they leave at the trainer's bye
    finally:
        for proc in (trainer, *servers):
            if proc.poll() is None:
                proc.kill()


def run(mode: str, root: Path, run_dir: Path, steps: int, extra: list[str]) -> dict:
    overrides = {**DEFAULTS, **MODES[mode], "trainer.run_dir": run_dir, "trainer.total_steps": steps,
                 "model.path": root / "model", "data.train_files": f"[{root / 'train.parquet'}]",
                 "data.val_files": f"[{root / 'test.parquet'}]"}
    address = ""
    if mode in FLEET_SERVERS:
        port = _free_port()
        overrides.update({"rollout.fleet.host": "127.0.0.1", "rollout.fleet.port": port})
        address = f"127.0.0.1:{port}"
    nproc = 1 if mode in FLEET_SERVERS else 2  # a fleet's trainer trains only: its servers are the second process
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "launch/ppo.py",
           "--config", "configs/tiny_cpu.yaml", *[f"{k}={v}" for k, v in overrides.items()], *extra]
    load_before = os.getloadavg()[0]
    _launch(mode, cmd, run_dir, dict(os.environ, PYTHONWARNINGS="ignore"), address)
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
    measured = rows[1:]  # after the warm-up step
    seconds = sum(r["timing_s/step"] for r in measured)
    import yaml

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    responses = len(measured) * resolved["data"]["prompts_per_step"] * resolved["rollout"]["samples_per_prompt"]
    out = {"samples_per_s": round(responses / seconds, 2), "seconds_per_step": round(seconds / len(measured), 4),
           "gen_s_per_step": round(sum(r["timing_s/gen"] for r in measured) / len(measured), 4),
           "update_s_per_step": round(sum(r.get("timing_s/update_actor", 0) + r.get("timing_s/update_critic", 0)
                                          for r in measured) / len(measured), 4),
           "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}  # before, after the launch
    if "async/trainer_wait_s" in rows[-1]:
        wait = sum(r["async/trainer_wait_s"] for r in measured)
        out["idle_fraction"] = {"train": round(wait / seconds, 4)}
        out["busy_s_per_step"] = {"train": round((seconds - wait) / len(measured), 4)}
        if "async/rollout_busy_s" in rows[-1]:  # separate placement's rollout rank reports its generating time
            busy = rows[-1]["async/rollout_busy_s"] - rows[0]["async/rollout_busy_s"]
            out["idle_fraction"]["rollout"] = round(max(0.0, 1 - busy / seconds), 4)
            out["busy_s_per_step"]["rollout"] = round(busy / len(measured), 4)
        out["staleness"] = {"max": max(r["async/staleness_max"] for r in rows),
                            "mean": round(sum(r["async/staleness_mean"] for r in measured) / len(measured), 4),
                            "dropped": sum(r["async/dropped_stale"] for r in rows)}
    else:
        out["rollout_phase_share"] = round(sum(r["timing_s/gen"] for r in measured) / seconds, 4)
    if mode in FLEET_SERVERS:
        out["fleet_servers"] = sorted({r["fleet/servers"] for r in rows})
    return out


def summarize(rounds: list[dict]) -> dict:
    """The rounds' runs per mode with the mode's median, the best K, and the median ratios."""
    names = [m for m in MODES if all(m in r for r in rounds)]
    modes = {}
    for mode in names:
        runs = [r[mode] for r in rounds]
        modes[mode] = {"samples_per_s": statistics.median(x["samples_per_s"] for x in runs), "runs": runs}
    out = {"modes": modes}
    asyncs = [m for m in ("separate_async_k1", "separate_async_k2") if m in modes]
    if not asyncs or "separate_sync" not in modes:
        return out
    best = max(asyncs, key=lambda m: modes[m]["samples_per_s"])

    def ratio(base: str) -> float:
        return round(statistics.median(r[best]["samples_per_s"] / r[base]["samples_per_s"] for r in rounds), 3)

    out["best_async"] = best
    out["separate_async_over_separate_sync"] = ratio("separate_sync")
    if "colocated_sync" in modes:
        out["separate_async_over_colocated_sync"] = ratio("colocated_sync")
    return out


def fleet_ratios(rounds: list[dict]) -> dict:
    """Each fleet mode's samples/s over separate-sync's (what a synchronous fleet replaces), an
    asynchronous fleet's also over separate placement at the same K (what it replaces) and over the
    synchronous fleet of as many servers: the medians of the rounds' ratios."""
    def ratio(mode: str, base: str) -> float | None:
        if not all(mode in r and base in r for r in rounds):
            return None
        return round(statistics.median(r[mode]["samples_per_s"] / r[base]["samples_per_s"] for r in rounds), 3)

    out = {}
    for mode in FLEET_SERVERS:
        k = MODES[mode].get("async.max_staleness", 0)
        bases = ["separate_sync"] + ([f"separate_async_k{k}", f"fleet_{FLEET_SERVERS[mode]}"] if k else [])
        for base in bases:
            if (value := ratio(mode, base)) is not None:
                out[f"{mode}_over_{base}"] = value
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="rounds of every mode (medians over them)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="key=value overrides for every launch")
    args = p.parse_args()
    chosen = args.modes.split(",")
    unknown = sorted(set(chosen) - set(MODES))
    if unknown:
        print(f"error: --modes {','.join(unknown)}: not a mode; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    from megarl.data.prepare import prepare_arithmetic

    rounds = []
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_arithmetic(root, "copy", 3, 2048, 64)
        for i in range(args.repeats):
            order = chosen[i % len(chosen):] + chosen[:i % len(chosen)]  # rotated: no mode always runs first
            rounds.append({mode: run(mode, root, root / f"round{i}" / mode, args.steps, args.overrides) for mode in order})
    result = {
        "command": " ".join(["python", "benchmarks/async_rl.py", f"--steps {args.steps}", f"--repeats {args.repeats}",
                             *([f"--modes {args.modes}"] if chosen != list(MODES) else []), *args.overrides]),
        "date": f"{start} - {time.strftime('%H:%M UTC', time.gmtime())}",
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "load_average_at_end": os.getloadavg()[0]},
        "settings": {**DEFAULTS, "nproc": 2, "steps": args.steps},
        **summarize(rounds),
        **fleet_ratios(rounds),
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
