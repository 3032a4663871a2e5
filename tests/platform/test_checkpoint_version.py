"""Engine checkpoints record the Megatron-Core release that wrote them; a release that cannot read
that format refuses with both versions named, before Megatron-Core's loader fails inside."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from megarl.platform import mcore_version
from megarl.platform.mcore_version import CheckpointVersionError, can_read, require_readable_checkpoint


@pytest.mark.parametrize(
    "written_by,reader,readable",
    [
        ("0.16.1", "0.16.1", True),
        ("0.16.1", "0.19.2", True),  # newer releases read the common.pt of older ones
        ("0.17.1", "0.18.2", True),
        ("0.19.0", "0.19.2", True),
        ("0.19.2", "0.19.0", True),  # patch releases share a format
        ("0.19.2", "0.16.1", False),  # 0.19 writes no common.pt; 0.16 needs one
        ("0.19.2", "0.18.2", False),
        ("0.20.0", "0.19.2", False),  # newer than megarl knows: its format is unknown
        ("0.20.0", "0.20.1", True),
    ],
)
def test_which_release_reads_which_checkpoint(written_by, reader, readable):
    assert can_read(written_by, reader) is readable


def test_refusal_names_both_versions(tmp_path):
    (tmp_path / mcore_version.VERSION_FILE).write_text(json.dumps({"megatron_core": "0.19.2"}))
    with pytest.raises(CheckpointVersionError) as err:
        require_readable_checkpoint(str(tmp_path), reader="0.16.1")
    assert str(err.value) == (
        f"checkpoint {tmp_path} was written by megatron-core 0.19.2, whose checkpoint format megatron-core "
        "0.16.1 (installed) cannot read. Load it with megatron-core 0.19.2 or newer "
        "(Python 3.12: pip install 'megatron-core==0.19.2')"
    )
    require_readable_checkpoint(str(tmp_path), reader="0.19.0")  # no error


def test_unrecorded_checkpoints_are_from_016(tmp_path):
    # Written before megarl recorded the version, when 0.16 was the only supported release.
    assert mcore_version.checkpoint_version(str(tmp_path)) == "0.16.1"
    require_readable_checkpoint(str(tmp_path), reader="0.19.2")


def test_engine_checkpoint_records_the_installed_release(tiny_models, world_of_one, tmp_path):
    from megarl.engine.engine import EngineConfig, MegatronEngine

    engine = MegatronEngine(str(tiny_models["qwen2"]), world_of_one, EngineConfig())
    ckpt = tmp_path / "ckpt"
    engine.save(str(ckpt))
    installed = mcore_version.installed_version()
    assert json.loads((ckpt / mcore_version.VERSION_FILE).read_text()) == {"megatron_core": installed}
    assert "+" not in installed  # no local label (0.19 appends the cwd's git commit to __version__)
    engine.load(str(ckpt))  # this release reads its own checkpoint

    # The same checkpoint claiming a release newer than megarl knows: the engine refuses it.
    (ckpt / mcore_version.VERSION_FILE).write_text(json.dumps({"megatron_core": "0.20.0"}))
    with pytest.raises(CheckpointVersionError, match=f"written by megatron-core 0.20.0, whose checkpoint format "
                                                     f"megatron-core {installed} \\(installed\\) cannot read"):
        engine.load(str(ckpt))


@pytest.mark.slow
def test_resume_from_an_unreadable_checkpoint_exits_2_with_one_message(tmp_path):
    """launch/ppo.py resuming a run whose checkpoint a newer Megatron-Core wrote: exit 2, one line."""
    from megarl.data.prepare import prepare_arithmetic

    run_dir = tmp_path / "run"
    prepare_arithmetic(tmp_path, "copy", 3, 64, 8)  # auto_prepare never writes a path given on the command line
    overrides = [f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
                 f"data.val_files=[{tmp_path / 'test.parquet'}]", "data.arithmetic.train_size=64",
                 "data.arithmetic.val_size=8", "data.prompts_per_step=4", "rollout.samples_per_prompt=2",
                 "trainer.total_steps=1", "trainer.save_every_steps=1", "tracking.progress_bar=false",
                 f"trainer.run_dir={run_dir}"]
    cmd = [sys.executable, "launch/ppo.py", "--config", "configs/tiny_cpu.yaml"]  # one process, no torchrun
    # Without the rendezvous variables world_of_one set in this process (its port is taken).
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    first = subprocess.run([*cmd, *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    (actor,) = run_dir.glob("checkpoints/step_*/actor")
    assert mcore_version.checkpoint_version(str(actor)) == mcore_version.installed_version()
    (actor / mcore_version.VERSION_FILE).write_text(json.dumps({"megatron_core": "0.20.0"}))
    again = subprocess.run([*cmd, *overrides, "trainer.total_steps=2", "trainer.resume_allow_changes=true"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "Traceback" not in again.stderr, again.stderr
    errors = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint {actor} was written by megatron-core 0.20.0, whose checkpoint format megatron-core "
        f"{mcore_version.installed_version()} (installed) cannot read."), again.stderr


OTHER_PYTHON = os.environ.get("MEGARL_OTHER_PYTHON")


def _run(python: str, nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(not OTHER_PYTHON, reason="set MEGARL_OTHER_PYTHON to the other environment's python (make test does)")
def test_checkpoint_written_by_the_other_release(tiny_models, tmp_path):
    """Real checkpoints across the two environments `make test` builds (0.16.1 and 0.19.x): the newer
    release resumes the older one's checkpoint exactly; the older one refuses the newer one's."""
    probe = "import megatron.core; print(megatron.core.__version__.split('+')[0])"
    other = subprocess.run([OTHER_PYTHON, "-c", probe], capture_output=True, text=True, check=True).stdout.split()[-1]
    ours = mcore_version.installed_version()
    assert mcore_version.minor_line(other) != mcore_version.minor_line(ours), "MEGARL_OTHER_PYTHON has the same release"
    ckpt, worker = tmp_path / "ckpt", ["tests/engine/engine_worker.py", "--model", str(tiny_models["qwen2"])]

    saved = _run(OTHER_PYTHON, 2, [*worker, "--mode", "save", "--tp", "2", "--ckpt", str(ckpt), "--out", str(tmp_path / "s.pt")])
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert mcore_version.checkpoint_version(str(ckpt)) == other
    shutil.copytree(ckpt, tmp_path / "copy")
    resumed = _run(sys.executable, 2, [*worker, "--mode", "resume", "--ckpt", str(ckpt), "--out", str(tmp_path / "ours.pt")])
    if can_read(other, ours):
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        # The writer resumes its own checkpoint: both releases take the same next step.
        reference = _run(OTHER_PYTHON, 2, [*worker, "--mode", "resume", "--ckpt", str(tmp_path / "copy"),
                                           "--out", str(tmp_path / "theirs.pt")])
        assert reference.returncode == 0, reference.stderr[-3000:]
        a, b = (torch.load(tmp_path / f, weights_only=False) for f in ("ours.pt", "theirs.pt"))
        assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-6)
        for name, weight in b["weights"].items():
            torch.testing.assert_close(a["weights"][name], weight, rtol=1e-6, atol=1e-7, msg=name)
    else:
        assert resumed.returncode != 0
        assert (f"was written by megatron-core {other}, whose checkpoint format megatron-core {ours} (installed) "
                "cannot read") in resumed.stderr
        assert "common.pt" not in resumed.stderr  # refused before Megatron-Core's loader ran
