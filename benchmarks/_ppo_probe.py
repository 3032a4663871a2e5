"""launch/ppo.py with benchmark hooks, for benchmarks/suite.py and the regression gate (benchmarks/gate.py).

    python benchmarks/_ppo_probe.py [--code-root DIR] --config configs/X.yaml [key=value ...]

`--code-root DIR` runs DIR's megarl and DIR's launch/ppo.py under this (the candidate's) instrument, so the
gate measures a base checkout and the candidate with the same probe.

- Per phase (the trainer's `timing_s/<phase>` clocks): wall seconds (CUDA events at device-synchronised edges
  on a GPU, benchmarks/phase_clock.py) and the process's CPU seconds, logged as `bench/wall_s/<phase>` and
  `bench/cpu_s/<phase>`; the whole ppo_step as phase `step`. Outside the gate also
  `bench/calibration_cpu_s`: the CPU time of a fixed workload like the actor update run before and after every
  PPO step (the record's figures are ratios to it).
- Gate mode (MEGARL_BENCH_GATE_FDS=<control fd>,<report fd>, set by benchmarks/gate.py): before every step
  the probe writes {"event": "ready"} to the report fd and waits for a line on the control fd, then runs the
  step and writes {"event": "step", "wall_s": {...}, "cpu_s": {...}}. The gate so runs the base and the
  candidate one step at a time, never both at once, interleaved round by round.
- Injected regressions (MEGARL_BENCH_INJECT=<name>:<fraction>[,...], read here only, never by megarl's
  training code): the gate's own tests put each into the candidate to show that the gate fails naming the
  phase. Each adds `fraction` x the wrapped call's own wall time:
    train_step_stall  MegatronEngine.train_step sleeps after every call (a stall: a barrier, a blocking
                      host sync, a slow collective; wall time, no CPU time) -> phase update_actor
    generate_busy     the rollout engine's generate busy-loops after every call (extra work) -> phase gen
    sync_barrier      HybridEngine.hand_over ends with an extra barrier that waits (on one process a
                      barrier returns at once, so the wait a slower peer would cause is slept) -> phase sync
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_clock import clock_for_this_machine  # noqa: E402

INJECTIONS = ("train_step_stall", "generate_busy", "sync_barrier")


def parse_injections(spec: str | None) -> dict[str, float]:
    """'train_step_stall:0.25,generate_busy:0.25' -> {name: fraction}; ValueError naming the bad part."""
    out = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, _, fraction = part.strip().partition(":")
        try:
            value = float(fraction)
        except ValueError:
            value = -1.0
        if name not in INJECTIONS or value <= 0:
            raise ValueError(f"MEGARL_BENCH_INJECT: {part.strip()!r} is not <name>:<fraction > 0> with name one of "
                             f"{', '.join(INJECTIONS)} (e.g. train_step_stall:0.25)")
        out[name] = value
    return out


def calibration_cpu_seconds(repeats: int = 3) -> float:
    """Median CPU seconds of a fixed training workload shaped like the demo's actor update (a
    hidden-64, two-layer MLP stack on 1,024 tokens: forward, backward, Adam). Work of the same
    kind suffers the same cache and core-sharing slowdowns from the neighbours, so the ratio to
    it holds still where a generic calibration did not (a matmul/Python mix moved 0.73x between
    two runs while the phases moved 0.87x)."""
    import torch  # here: the gate imports this module for parse_injections, torch-free

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(2) for m in (torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))])
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(1024, 64)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(4):
            loss = net(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


def _spin_wall(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _barrier_and_wait(seconds: float) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    time.sleep(seconds)


def _after_each_call(cls, method: str, extra) -> None:
    """cls.method now calls `extra(seconds the call took)` after every call (the injection scales it)."""
    original = getattr(cls, method)

    def wrapped(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = original(self, *args, **kwargs)
        extra(time.perf_counter() - t0)
        return out

    setattr(cls, method, wrapped)


def install_injections(injections: dict[str, float], rollout_engine_class) -> None:
    from megarl.engine.engine import MegatronEngine
    from megarl.hybrid.engine import HybridEngine

    for name, fraction in injections.items():
        if name == "train_step_stall":
            _after_each_call(MegatronEngine, "train_step", lambda s, f=fraction: time.sleep(f * s))
        elif name == "generate_busy":
            _after_each_call(rollout_engine_class, "generate", lambda s, f=fraction: _spin_wall(f * s))
        elif name == "sync_barrier":
            _after_each_call(HybridEngine, "hand_over", lambda s, f=fraction: _barrier_and_wait(f * s))


class _GateLink:
    """The gate's two pipes: wait for its go before a step, report the step's times after it."""

    def __init__(self, fds: str):
        control, report = (int(fd) for fd in fds.split(","))
        self.control, self.report = os.fdopen(control, "r"), os.fdopen(report, "w")

    def send(self, message: dict) -> None:
        self.report.write(json.dumps(message) + "\n")
        self.report.flush()

    def wait_for_go(self) -> None:
        self.send({"event": "ready"})
        if self.control.readline().strip() != "go":  # the gate went away: stop here, not mid-step
            raise SystemExit(3)


def phase_timer_class() -> type:
    """The class that times the trainer's phases: megarl.step.phase_clock.PhaseTimer, or, in the
    revisions before issue 40 moved it (a base the gate measures against can be one), megarl.trainer._Timer."""
    try:
        from megarl.step.phase_clock import PhaseTimer
        return PhaseTimer
    except ImportError:
        from megarl import trainer as trainer_module

        timer = getattr(trainer_module, "_Timer", None)
        if timer is None:
            raise SystemExit("benchmarks/_ppo_probe.py: neither megarl.step.phase_clock.PhaseTimer nor "
                             "megarl.trainer._Timer is there; update the phase hooks")
        return timer


def install() -> None:
    from megarl import trainer as trainer_module

    timer = phase_timer_class()
    try:
        injections = parse_injections(os.environ.get("MEGARL_BENCH_INJECT"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    link = _GateLink(os.environ["MEGARL_BENCH_GATE_FDS"]) if os.environ.get("MEGARL_BENCH_GATE_FDS") else None
    clock = clock_for_this_machine()
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    enter, exit_ = timer.__enter__, timer.__exit__

    def timed_enter(self):
        result = enter(self)
        self._bench_token = clock.start()  # after the trainer's own entry work (profiler range, heartbeat)
        return result

    def timed_exit(self, *exc):
        t = clock.stop(self._bench_token)
        phase = self.name.removeprefix("timing_s/")
        wall[phase] = wall.get(phase, 0.0) + t.wall_s
        cpu[phase] = cpu.get(phase, 0.0) + t.cpu_s
        return exit_(self, *exc)

    timer.__enter__, timer.__exit__ = timed_enter, timed_exit
    step = trainer_module.Trainer.ppo_step
    installed = []

    def ppo_step(self):
        if not installed:  # the rollout engine's class is known once the trainer is built
            install_injections(injections, type(self.rollout))
            installed.append(True)
        if link is not None:
            link.wait_for_go()
        before = None if link else calibration_cpu_seconds()
        wall.clear()
        cpu.clear()
        token = clock.start()
        result = step(self)  # StepResult(metrics, events)
        whole = clock.stop(token)
        wall["step"], cpu["step"] = whole.wall_s, whole.cpu_s
        if link is not None:
            link.send({"event": "step", "wall_s": dict(wall), "cpu_s": dict(cpu)})
        else:
            result.metrics.update({f"bench/wall_s/{k}": v for k, v in wall.items()})
            result.metrics.update({f"bench/cpu_s/{k}": v for k, v in cpu.items() if k != "step"})
            result.metrics["bench/calibration_cpu_s"] = (before + calibration_cpu_seconds()) / 2
        return result

    trainer_module.Trainer.ppo_step = ppo_step


if __name__ == "__main__":
    code_root = REPO
    if sys.argv[1:2] == ["--code-root"]:
        code_root = Path(sys.argv[2]).resolve()
        del sys.argv[1:3]
    sys.path.insert(0, str(code_root))  # this checkout's megarl, not an installed one
    install()
    sys.argv = [str(code_root / "launch" / "ppo.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
