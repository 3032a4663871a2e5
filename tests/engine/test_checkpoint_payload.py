"""Checkpoint files are loaded with weights_only=True: a planted pickle payload is refused with a
clear error and never runs (issue 11, item 10). Each test plants a payload that would create a
marker file, and checks that the load fails and the marker does not exist."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from megarl.platform.safe_load import UnsafeCheckpointError, load_plain


class _Payload:
    """Unpickling this calls exec(code): what an attacker plants in a checkpoint."""

    def __init__(self, marker):
        self.code = f"open({str(marker)!r}, 'w').write('pwned')"

    def __reduce__(self):
        return (exec, (self.code,))


def _plant(path, marker, wrap=lambda p: p):
    torch.save(wrap(_Payload(marker)), path)


def test_a_payload_in_a_plain_file_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "marker"
    _plant(tmp_path / "trainer.pt", marker, wrap=lambda p: {"step": 3, "lr_scale": p})
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*trainer\.pt.*could run code"):
        load_plain(tmp_path / "trainer.pt")
    assert not marker.exists()
    torch.save({"step": 3, "x": torch.ones(2), "t": (1, "a", None)}, tmp_path / "ok.pt")
    assert load_plain(tmp_path / "ok.pt")["step"] == 3


def test_trainer_pt_payload_is_refused_on_resume(tmp_path):
    from megarl.checkpointing import checkpoint

    marker = tmp_path / "marker"
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    _plant(ckpt / "trainer.pt", marker, wrap=lambda p: {"step": 2, "kl_ctrl": p})
    trainer = SimpleNamespace(checkpointed_engines=lambda: {}, load_state_dict=lambda state: None)
    with pytest.raises(UnsafeCheckpointError):
        checkpoint.restore(trainer, ckpt)
    assert not marker.exists()


@pytest.mark.parametrize("victim", ["rng", "engine_extra"])
@pytest.mark.slow  # builds Megatron engines: ~30 s on 2 busy cores
def test_engine_checkpoint_payloads_are_refused(tiny_models, world_of_one, tmp_path, victim):
    from megarl.engine.checkpointing import EXTRA_STATE_FILE, _rng_file
    from megarl.engine.engine import EngineConfig, MegatronEngine

    engine = MegatronEngine(str(tiny_models["qwen2"]), world_of_one, EngineConfig())
    ckpt = tmp_path / "ckpt"
    engine.save(str(ckpt))
    engine.load(str(ckpt))  # what megarl wrote loads under weights_only=True (numpy RNG state included)
    marker = tmp_path / "marker"
    target = _rng_file(str(ckpt), 0) if victim == "rng" else str(ckpt / EXTRA_STATE_FILE)
    _plant(target, marker, wrap=lambda p: {"layout": p})
    with pytest.raises(UnsafeCheckpointError, match=victim):
        engine.load(str(ckpt))
    assert not marker.exists()
    shutil.rmtree(ckpt)


@pytest.mark.slow  # builds Megatron engines: ~30 s on 2 busy cores
def test_dcp_metadata_payload_is_refused(tiny_models, world_of_one, tmp_path):
    import pickle

    from megarl.engine.engine import EngineConfig, MegatronEngine

    engine = MegatronEngine(str(tiny_models["qwen2"]), world_of_one, EngineConfig())
    ckpt = tmp_path / "ckpt"
    engine.save(str(ckpt))
    marker = tmp_path / "marker"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))  # DCP reads it with pickle.load
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*builtins\.exec"):
        engine.load(str(ckpt))
    assert not marker.exists()


def test_dcp_bytes_item_payload_is_refused(world_of_one, tmp_path):
    # A non-tensor item inside a .distcp file is unpickled by DCP's planner: weights_only there too.
    import io

    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from megarl.engine.checkpointing import _plain_bytes_only

    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save({"param_groups": _Payload(marker)}, buf)
    planner = default_planner.DefaultLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("optimizer.groups"), torch.Size([0]), MetadataIndex("optimizer.groups"),
                    torch.Size([0]), torch.Size([0]))
    with _plain_bytes_only(str(tmp_path)), pytest.raises(UnsafeCheckpointError, match="optimizer.groups"):
        planner.load_bytes(item, io.BytesIO(buf.getvalue()))
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save({"lr": 0.1}, plain)
    with _plain_bytes_only(str(tmp_path)):
        planner.load_bytes(item, io.BytesIO(plain.getvalue()))
    assert planner.state_dict["optimizer.groups"] == {"lr": 0.1}


@pytest.mark.slow  # builds Megatron engines: ~30 s on 2 busy cores
def test_a_save_starts_no_process_that_would_outlive_a_killed_run(tiny_models, world_of_one, tmp_path):
    # Issue 11, item 8: Megatron's writer used a spawned Manager server (~300 MB) and the resource
    # tracker; kill -9 of the trainer left both alive for good. After a save, neither exists.
    import multiprocessing
    from multiprocessing import resource_tracker

    from megarl.engine.engine import EngineConfig, MegatronEngine

    engine = MegatronEngine(str(tiny_models["qwen2"]), world_of_one, EngineConfig())
    before = {p.pid for p in multiprocessing.active_children()}
    engine.save(str(tmp_path / "ckpt"))
    engine.load(str(tmp_path / "ckpt"))
    assert {p.pid for p in multiprocessing.active_children()} - before == set()
    assert getattr(resource_tracker._resource_tracker, "_pid", None) is None


@pytest.mark.slow  # builds Megatron engines: ~30 s on 2 busy cores
def test_a_checkpoint_of_another_architecture_is_one_clear_error(tiny_models, world_of_one, tmp_path):
    # Issue 11, item 12: Megatron's shape mismatch came out as a long DCP traceback.
    from megarl.engine.checkpointing import CheckpointMismatch
    from megarl.engine.engine import EngineConfig, MegatronEngine

    MegatronEngine(str(tiny_models["qwen2"]), world_of_one, EngineConfig()).save(str(tmp_path / "qwen2"))
    other = MegatronEngine(str(tiny_models["qwen3"]), world_of_one, EngineConfig())
    with pytest.raises(CheckpointMismatch, match=r"does not fit this model .*model.path it was trained from"):
        other.load(str(tmp_path / "qwen2"))
