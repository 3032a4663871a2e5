"""Misconfigurations exit with code 2 and a one-line message naming the problem, no traceback.

The config refusals (megarl.run.check_config: every one is decided before torch.distributed loads) are
checked in this process, one per key; the exit-2 contract of launch/ppo.py itself is checked end to end
once per kind of refusal: a config error in one process and under torchrun, a run directory in use or
not writable (after the process groups exist).
"""
from __future__ import annotations

import subprocess

import pytest

from conftest import REPO, torchrun


def run_launch(args: list[str], world_size: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    """One plain process that believes it is one of world_size (the checks run before any rendezvous)."""
    return torchrun(0, ["launch/ppo.py", *args], timeout=120, env={"WORLD_SIZE": str(world_size), **(env or {})}, check=False)


def refusal(args: list[str], capsys, monkeypatch, world_size: int = 1) -> list[str]:
    """launch/ppo.py's config check in this process, as rank 0 of world_size runs it: the non-empty lines
    it printed to stderr, asserting that it refused (the launcher turns that into exit code 2)."""
    from megarl.run import Refused, check_config

    assert args[0] == "--config"
    monkeypatch.chdir(REPO)  # config and data paths as the launcher, run from the checkout, reads them
    monkeypatch.delenv("RANK", raising=False)
    capsys.readouterr()
    with pytest.raises(Refused):
        check_config(args[1], args[2:], world_size)
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "args,world,expected",
    [
        (["--config", "configs/tiny_cpu.yaml", "actor.optim.lrr=1e-6"], 1, "actor.optim.lr"),  # unknown key, nearest named
        (["--config", "configs/tiny_cpu.yaml", "parallel.tp=two"], 1, "parallel.tp"),  # wrong type
        (["--config", "configs/tiny_cpu.yaml", "parallel.tp=4"], 2, "world size 2 is not divisible"),  # impossible layout
        (["--config", "configs/tiny_cpu.yaml", "algorithm.adv_estimator=ppo2"], 1, "gae"),  # unknown enum lists valid ones
        (["--config", "configs/tiny_cpu.yaml", "data.auto_prepare=null", "data.train_files=[/nonexistent/train.parquet]"], 1,
         "/nonexistent/train.parquet"),  # missing data file
        (["--config", "configs/does_not_exist.yaml"], 1, "configs/does_not_exist.yaml"),  # missing config file
        (["--config", "configs/tiny_cpu.yaml", "model.make_tiny.enable=false", "model.path=/nonexistent/model"], 1,
         "/nonexistent/model"),  # missing model directory
        (["--config", "configs/tiny_cpu.yaml", "data.prompts_per_step=33"], 2, "not divisible"),  # batch sizes
        # issue 11: a typed data path is never auto-prepared; a directory is called a directory
        (["--config", "configs/tiny_cpu.yaml", "data.train_files=[/nonexistent/x.parquet]"], 1,
         "not one given on the command line"),
        (["--config", "configs/tiny_cpu.yaml", "data.auto_prepare=null", "data.train_files=[/tmp]"], 1, "/tmp is a directory"),
        # issue 11: values that validated but could not work
        (["--config", "configs/tiny_cpu.yaml", "algorithm.kl_penalty=full"], 1, "needs the logits"),
        (["--config", "configs/tiny_cpu.yaml", "actor.use_kl_loss=true", "actor.kl_loss_type=full"], 1, "actor.kl_loss_type=full"),
        (["--config", "configs/tiny_cpu.yaml", "actor.policy_loss=gspo", "actor.clip_ratio=0.3"], 1,
         "does not apply to actor.policy_loss=gspo"),
        (["--config", "configs/tiny_cpu.yaml", "actor.use_kl_loss=true", "guards.kl_threshold=0.1",
          "guards.kl_action=raise_coef"], 1, "nothing reads it"),
        (["--config", "configs/tiny_cpu.yaml", "guards.kl_threshold=0.1"], 1, "no KL to watch"),
    ],
    ids=["unknown-key", "wrong-type", "layout", "enum", "missing-data", "missing-config", "missing-model", "batch-size",
         "typed-data-path", "data-dir", "kl-penalty-full", "kl-loss-full", "gspo-clip", "raise-coef-unread", "kl-guard-no-kl"],
)
def test_misconfiguration_is_refused_in_one_line(args, world, expected, capsys, monkeypatch):
    lines = refusal(args, capsys, monkeypatch, world)
    assert len(lines) == 1, lines
    assert lines[0].startswith("config error: ") and expected in lines[0], lines[0]


def test_a_config_error_exits_2_with_one_line_and_no_traceback():
    """The launcher end to end, once for every config refusal above (they share this path)."""
    proc = run_launch(["--config", "configs/tiny_cpu.yaml", "actor.optim.lrr=1e-6"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "actor.optim.lr" in lines[0], proc.stderr


def test_typed_data_path_is_not_created(tmp_path, capsys, monkeypatch):
    typed = tmp_path / "nonexistent" / "x.parquet"
    refusal(["--config", "configs/tiny_cpu.yaml", f"data.train_files=[{typed}]"], capsys, monkeypatch)
    assert not (tmp_path / "nonexistent").exists()


def test_duplicate_yaml_keys_are_refused(tmp_path, capsys, monkeypatch):
    config = tmp_path / "dup.yaml"
    config.write_text("trainer:\n  total_steps: 3\n  seed: 1\n  total_steps: 5\n")
    lines = refusal(["--config", str(config)], capsys, monkeypatch)
    assert len(lines) == 1 and "key 'total_steps' appears twice in one section (lines 2 and 4)" in lines[0], lines


def test_missing_vllm_is_a_config_error(capsys, monkeypatch):
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin not in (None, "namespace"):
        pytest.skip("vllm is installed here")
    lines = refusal(["--config", "configs/tiny_cpu.yaml", "rollout.engine=vllm"], capsys, monkeypatch)
    assert len(lines) == 1 and "rollout.engine=vllm: the vllm package is not installed here" in lines[0], lines


def test_a_run_dir_in_use_is_refused_naming_the_holder(tmp_path):
    import os

    from megarl.checkpointing.checkpoint_io import RunDirLock

    with RunDirLock(tmp_path / "run"):
        proc = run_launch(["--config", "configs/tiny_cpu.yaml", f"trainer.run_dir={tmp_path / 'run'}",
                           f"model.path={tmp_path / 'model'}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"pid {os.getpid()}" in proc.stderr and "another trainer.run_dir" in proc.stderr
    assert not (tmp_path / "model").exists()  # refused before anything was created


@pytest.mark.multiprocess
def test_a_config_error_under_torchrun_is_printed_once():
    # fresh: this is about torchrun itself (it stops the other workers as soon as one exits)
    proc = torchrun(2, ["launch/ppo.py", "--config", "configs/tiny_cpu.yaml", "parallel.tp=two"], timeout=300, check=False,
                    fresh=True)
    assert proc.returncode != 0
    assert proc.stderr.count("config error: parallel.tp") == 1, proc.stderr


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(options) -> a fresh tmpfs at tmp_path/mnt (root only; skipped, visibly, elsewhere)."""
    import os

    mounts = []

    def mount(options: str):
        target = tmp_path / f"mnt{len(mounts)}"
        target.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                                               capture_output=True).returncode != 0:
            pytest.skip("needs root to mount a tmpfs")
        mounts.append(target)
        return target

    yield mount
    for target in mounts:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.mark.parametrize("state", ["read-only", "full"])
def test_a_run_dir_that_cannot_be_written_exits_2_with_one_line(small_tmpfs, tmp_path, state):
    import errno
    import os

    if state == "read-only":
        mnt = small_tmpfs("ro,size=1m")
    else:
        mnt = small_tmpfs("size=8k")
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)  # fill it: the next write gets ENOSPC
        try:
            while os.write(fd, b"x" * 1024):
                pass
        except OSError as err:
            assert err.errno == errno.ENOSPC
        finally:
            os.close(fd)
    run_dir = mnt / "run" if state == "full" else mnt
    proc = run_launch(["--config", "configs/tiny_cpu.yaml", f"trainer.run_dir={run_dir}", f"model.path={tmp_path / 'model'}"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr
    assert str(run_dir) in errors[0] and "writable and not full" in errors[0], errors[0]
    assert not (tmp_path / "model").exists()  # refused before anything was created
