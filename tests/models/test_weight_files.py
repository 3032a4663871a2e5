"""Weight files a user hands in or gets out (issue 11, items 12 and 14): a truncated .safetensors is
one clear error naming the file, and exported safetensors are readable by others (0644 under 022)."""
from __future__ import annotations

import os
import shutil
import stat

import pytest

from megarl.models.weights import SafetensorsDir


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("keep", [0.5, 0.001])  # data cut short / header cut short
def test_a_truncated_safetensors_file_is_one_clear_error(tiny_models, tmp_path, keep):
    model = _copy(tiny_models["qwen2"], tmp_path / "m")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: max(int(len(data) * keep), 9)])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated or not a safetensors file .*copy or download"):
        d = SafetensorsDir(model)
        d.full(next(iter(d.weight_map)))


def test_exported_safetensors_are_world_readable(tiny_models, world_of_one, tmp_path):
    from megarl.engine.engine import EngineConfig, MegatronEngine
    from megarl.models.weights import save_hf_checkpoint

    engine = MegatronEngine(str(tiny_models["qwen2"]), world_of_one, EngineConfig(), trainable=False)
    old = os.umask(0o022)
    try:
        save_hf_checkpoint(engine.module, engine.spec, world_of_one, tmp_path / "out", tiny_models["qwen2"])
    finally:
        os.umask(old)
    shards = sorted((tmp_path / "out").glob("*.safetensors"))
    assert shards and all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in shards)
