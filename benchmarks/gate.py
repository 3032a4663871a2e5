"""The paired regression gate (`make bench-check`, `python benchmarks/suite.py check --base REV`).

The candidate (this working tree, uncommitted changes included) and a base revision (default: the merge base
with main, or the last `bench-baseline*` tag when there is no main) run the same PPO demo in two checkouts with
one Python environment: the base is exported with `git archive` into a temp directory, and both run under the
candidate's probe (benchmarks/_ppo_probe.py --code-root), so the instrument is the same. Each side is one
long-lived process that runs a step only when told to; round by round the gate runs one step of each, the
order alternating (base first in even rounds, candidate first in odd ones), never both at once. Each phase's
wall time is the gated figure (CPU seconds beside it as a diagnostic); gate_stats.judge gives the verdict,
and a failure names the phase, the slowdown, its interval and the commit range.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import gate_stats
from _ppo_probe import parse_injections

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "benchmarks" / "_ppo_probe.py"
DEFAULT_CONFIG = "configs/tiny_cpu.yaml"
DEFAULT_WARMUP = 2
DEFAULT_ROUNDS = 30
STEP_TIMEOUT_S = 600.0  # a side that says nothing for this long is stuck


class GateError(Exception):
    """A reason the gate cannot measure (exit 2), said in one line."""


def _git(*args: str, repo: Path = REPO) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if proc.returncode:
        raise GateError(f"git {' '.join(args)}: {proc.stderr.strip() or 'failed'}")
    return proc.stdout.strip()


def resolve_base(rev: str | None, repo: Path = REPO) -> str:
    """The base commit's full hash: `rev`, else the merge base of HEAD with main (or origin/main), else the
    newest `bench-baseline*` tag reachable from HEAD."""
    try:
        _git("rev-parse", "--git-dir", repo=repo)
    except GateError:
        raise GateError(f"{repo} is not a git checkout: the gate needs the history to measure a base revision; "
                        "run it in a clone (or compare the stored record: python benchmarks/suite.py compare-record)")
    if rev:
        try:
            return _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", repo=repo)
        except GateError:
            raise GateError(f"--base {rev!r} is not a commit of this repository; pass a branch, tag or hash (e.g. --base main)")
    for branch in ("main", "origin/main"):
        try:
            return _git("merge-base", "HEAD", branch, repo=repo)
        except GateError:
            continue
    try:
        tag = _git("describe", "--tags", "--abbrev=0", "--match", "bench-baseline*", "HEAD", repo=repo)
        return _git("rev-parse", f"{tag}^{{commit}}", repo=repo)
    except GateError:
        raise GateError("no base revision: no branch 'main' to take the merge base with and no 'bench-baseline*' tag; "
                        "pass --base REV (e.g. --base HEAD~1)")


def commit_range(base: str, repo: Path = REPO) -> str:
    """'<base>..<HEAD>', with '(+ uncommitted changes)' when the working tree differs from HEAD."""
    head = _git("rev-parse", "HEAD", repo=repo)
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", repo=repo))
    return f"{base[:10]}..{head[:10]}" + (" (+ uncommitted changes)" if dirty else "")


def export_checkout(sha: str, dest: Path, repo: Path = REPO) -> Path:
    """The tracked files of commit `sha` under dest (git archive: no worktree bookkeeping to clean up)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest.parent / f"{dest.name}.tar"
    _git("archive", "--format=tar", "-o", str(archive), sha, repo=repo)
    with tarfile.open(archive) as tar:
        tar.extractall(dest)
    archive.unlink()
    return dest


class _Lines:
    """Whole lines from a pipe, with a timeout (os.read: no hidden buffer for select to miss)."""

    def __init__(self, fd: int):
        self.fd, self.buffer = fd, b""

    def next(self, timeout_s: float) -> str | None:
        """The next line, or None at end of file."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()


class Side:
    """One checkout's PPO process under the probe, stepped by the gate."""

    def __init__(self, name: str, root: Path, log: Path):
        self.name, self.root, self.log = name, root, log
        self.proc: subprocess.Popen | None = None
        self.wall: list[dict[str, float]] = []
        self.cpu: list[dict[str, float]] = []
        self.ran_first: list[bool] = []  # per recorded round, whether this side ran first in it (gate_stats compares like positions)

    def start(self, config: str, overrides: list[str], env: dict) -> None:
        control_r, self._control_w = os.pipe()
        report_r, report_w = os.pipe()
        env = {**env, "PYTHONPATH": str(self.root), "MEGARL_BENCH_GATE_FDS": f"{control_r},{report_w}"}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(PROBE), "--code-root", str(self.root), "--config", config,
                                          *overrides], cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(control_r, report_w))
        os.close(control_r)
        os.close(report_w)
        self.lines = _Lines(report_r)
        self._expect("ready", "before its first step")

    def _expect(self, event: str, when: str) -> dict | None:
        try:
            line = self.lines.next(STEP_TIMEOUT_S)
        except TimeoutError:
            raise GateError(f"the {self.name} side said nothing for {STEP_TIMEOUT_S:.0f} s {when}; its log: {self.log}")
        if line is None:
            code = self.proc.wait(timeout=STEP_TIMEOUT_S)
            if event == "ready" and when == "after its last step" and code == 0:
                return None
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
            raise GateError(f"the {self.name} side ({self.root}) stopped {when} (exit {code}); its log {self.log} ends:\n{tail}")
        message = json.loads(line)
        if message.get("event") != event:
            raise GateError(f"the {self.name} side sent {message.get('event')!r} where {event!r} was due ({when})")
        return message

    def step(self, last: bool, record: bool, first: bool) -> None:
        """Run one PPO step and wait until the process is idle again (ready for the next, or exited);
        first: whether it is the round's first step."""
        os.write(self._control_w, b"go\n")
        report = self._expect("step", "during a step")
        if record:
            self.wall.append(report["wall_s"])
            self.cpu.append(report["cpu_s"])
            self.ran_first.append(first)
        self._expect("ready", "after its last step" if last else "between steps")

    def stop(self) -> None:
        """End the process: a closed control pipe makes it leave before its next step; killed if it lingers."""
        if self.proc is None:
            return
        try:
            os.close(self._control_w)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_overrides(run_dir: Path, steps: int, extra: list[str]) -> list[str]:
    """The demo as the gate runs it: `steps` steps, no saving, no validation, the suite's data and model."""
    bench = REPO / "runs" / "bench"
    return [f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", "trainer.save_every_steps=0",
            f"trainer.val_every_steps={steps + 1}", "trainer.resume=never", "tracking.progress_bar=false",
            "tracking.mlflow=false", f"model.path={bench / 'tiny-llama-digits'}",
            f"data.train_files=[{bench / 'arithmetic' / 'train.parquet'}]",
            f"data.val_files=[{bench / 'arithmetic' / 'test.parquet'}]", *extra]


def run_paired(base_root: Path, work: Path, config: str, extra: list[str], warmup: int, rounds: int, max_rounds: int,
               inject: str | None, enough) -> tuple[Side, Side]:
    """Both sides' per-round phase times: `rounds` rounds, then `rounds` more at a time while
    `enough(base, candidate)` is false, up to max_rounds. `inject` (MEGARL_BENCH_INJECT) goes to the candidate only."""
    env = {k: v for k, v in os.environ.items() if k != "MEGARL_BENCH_INJECT"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    steps, done = warmup + max_rounds, 0
    base, candidate = Side("base", base_root, work / "base.log"), Side("candidate", REPO, work / "candidate.log")
    try:
        # One at a time: the model is made on first use, and setup should not compete with setup.
        base.start(config, run_overrides(work / "base_run", steps, extra), env)
        candidate.start(config, run_overrides(work / "candidate_run", steps, extra),
                        {**env, **({"MEGARL_BENCH_INJECT": inject} if inject else {})})

        def run(n: int, record: bool) -> None:
            nonlocal done
            for i in range(done, done + n):
                for k, side in enumerate((base, candidate) if i % 2 == 0 else (candidate, base)):
                    side.step(last=i == steps - 1, record=record, first=k == 0)
            done += n

        run(warmup, record=False)
        run(rounds, record=True)
        while done < steps and not enough(base, candidate):
            run(min(rounds, steps - done), record=True)
    finally:
        base.stop()
        candidate.stop()
    return base, candidate


def verdicts(base: Side, candidate: Side, tolerance: float, confidence: float,
             min_seconds: float) -> tuple[list[gate_stats.PhaseVerdict], list[str]]:
    """A verdict per phase both sides ran in every round; and the phases only one side ran."""
    def phases(side: Side) -> set[str]:
        return set.intersection(*(set(r) for r in side.wall))

    both = phases(base) & phases(candidate)
    order = list(base.wall[0])  # the phases in the step's order, then 'step' (the probe adds it last)
    out = [gate_stats.judge(ph, [r[ph] for r in base.wall], [r[ph] for r in candidate.wall], tolerance, confidence, min_seconds,
                            [r[ph] for r in base.cpu], [r[ph] for r in candidate.cpu], base.ran_first)
           for ph in sorted(both, key=order.index)]
    return out, sorted(phases(base) ^ phases(candidate))


def _the_base(base_rev: str | None, base_dir: Path | None) -> tuple[str | None, str]:
    """(the base commit, or None for a --base-dir checkout; the commit range a failure names)."""
    if base_dir is None:
        base_sha = resolve_base(base_rev)
        return base_sha, commit_range(base_sha)
    if base_rev:
        raise GateError("--base and --base-dir name two bases: give one")
    if not (base_dir / "launch" / "ppo.py").is_file() or not (base_dir / "megarl").is_dir():
        raise GateError(f"--base-dir {base_dir}: not a megarl checkout (no launch/ppo.py and megarl/ in it)")
    return None, f"{base_dir}..(this tree)"


def check(base_rev: str | None, rounds: int, max_rounds: int, warmup: int, config: str, extra: list[str], tolerance: float,
          confidence: float, min_seconds: float, out: Path, prepare=lambda: None, base_dir: Path | None = None) -> int:
    """The gate: 0 passed, 1 a phase regressed, 2 it could not measure (one line says why). `prepare` writes
    the run's data when missing, once the arguments are known to be good. `base_dir`: a base checkout
    exported beforehand (`git archive REV | tar -x -C DIR`), for a machine without the history (the GPU one)."""
    inject = os.environ.get("MEGARL_BENCH_INJECT")
    if rounds < 3 or warmup < 0 or max_rounds < rounds:
        print(f"error: --rounds {rounds} / --max-rounds {max_rounds} / --warmup {warmup}: need at least 3 rounds (the "
              "interval needs a spread), --max-rounds at least --rounds, and no negative warm-up", file=sys.stderr)
        return 2
    try:
        parse_injections(inject)
        base_sha, commits = _the_base(base_rev, base_dir)
        if not (REPO / config).is_file():
            raise GateError(f"--config {config}: no such file under {REPO}")
        prepare()
        started, load_before = time.monotonic(), os.getloadavg()
        with tempfile.TemporaryDirectory(prefix="megarl-bench-check-") as tmp:
            work = Path(tmp)
            base_root = base_dir.resolve() if base_dir is not None else export_checkout(base_sha, work / "base")
            print(f"bench-check: {commits}: {warmup} warm-up + {rounds} paired rounds (up to {max_rounds} while a phase "
                  f"is inconclusive) of {config}"
                  f"{' ' + ' '.join(extra) if extra else ''}{f' (candidate injected: {inject})' if inject else ''}", flush=True)
            try:
                def enough(base: Side, candidate: Side) -> bool:
                    return not any(v.inconclusive for v in verdicts(base, candidate, tolerance, confidence, min_seconds)[0])

                base, candidate = run_paired(base_root, work, str(REPO / config), extra, warmup, rounds, max_rounds, inject, enough)
            except GateError:
                for log in ("base.log", "candidate.log"):  # the temp dir goes: keep the logs
                    if (work / log).is_file():
                        out.parent.mkdir(parents=True, exist_ok=True)
                        (out.parent / f"check-{log}").write_text((work / log).read_text(errors="replace"))
                raise
    except (GateError, ValueError) as e:
        print(f"error: bench-check: {e}", file=sys.stderr)
        return 2
    seconds = time.monotonic() - started
    record = {"base": base_sha or str(base_dir), "commits": commits, "config": config, "overrides": extra, "warmup": warmup,
              "injected_into_candidate": inject, "tolerance": tolerance, "confidence": confidence, "gate_seconds": seconds,
              "load_average_1_5_15": {"before": list(load_before), "after": list(os.getloadavg())}}
    return report(base, candidate, tolerance, confidence, min_seconds, commits, record, out)


def report(base: Side, candidate: Side, tolerance: float, confidence: float, min_seconds: float, commits: str,
           record: dict, out: Path) -> int:
    """Print the verdicts (a REGRESSION line per failing phase), write them and the samples to `out`; 1 on a failure."""
    results, one_sided = verdicts(base, candidate, tolerance, confidence, min_seconds)
    print(f"{'':>12}  {'phase':<14} wall: candidate vs base, median over rounds (each side at the same position in its rounds), ratio [{confidence:.0%} interval]; cpu: diagnostic")
    for v in results:
        print(v.line())
    for phase in one_sided:
        print(f"{'not gated':>12}  {phase:<14} run by one side only (a phase added or removed)")
    measured = len(base.wall)
    failures = [v.failure(measured, commits, confidence) for v in results if v.regressed]
    for f in failures:
        print(f"REGRESSION: {f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        **record, "rounds": measured, "verdicts": [asdict(v) for v in results],
        "samples": {side.name: {"wall_s": side.wall, "cpu_s": side.cpu, "ran_first": side.ran_first} for side in (base, candidate)},
    }, indent=1) + "\n")
    unsure = [v.phase for v in results if v.inconclusive]
    print(f"bench-check: {'FAILED' if failures else 'passed'} ({measured} rounds, {record['gate_seconds']:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f}; samples in {out})")
    if unsure and not failures:
        print(f"bench-check: inconclusive for {', '.join(unsure)}: after {measured} rounds the interval still reaches above "
              f"+{tolerance:.0%}, too noisy to rule out a regression; rerun on a quieter machine or with more --max-rounds")
    return 1 if failures else 0
