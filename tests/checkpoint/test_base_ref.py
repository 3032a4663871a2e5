"""megarl.models.base_ref: the base model a LoRA checkpoint names is recognised by content -- the
same files give the same hash wherever they lie, one changed base tensor changes it -- and a
checkpoint resumed onto another base is refused with one line naming the checkpoint, both bases and the fix."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.models import base_ref


@pytest.fixture
def base(tmp_path):
    """A model directory as the hash sees one: config.json and a safetensors file of base tensors."""
    out = tmp_path / "base"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 8}')
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(16, 8, generator=g),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g)},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_fingerprint_is_stable_and_follows_the_content(base, tmp_path):
    ref = base_ref.fingerprint(base)
    assert ref.path == str(base.resolve()) and len(ref.sha256) == 64 and ref.files == 2  # config.json + model.safetensors
    assert ref.bytes == sum(f.stat().st_size for f in (base / "config.json", base / "model.safetensors"))
    assert base_ref.fingerprint(base) == ref  # memoised, and the same again
    moved = tmp_path / "elsewhere"
    shutil.copytree(base, moved)  # same bytes elsewhere: the same base
    assert base_ref.fingerprint(moved).sha256 == ref.sha256
    (moved / "tokenizer_config.json").write_text("{}")  # not a weight: does not change the base
    assert base_ref.fingerprint(moved).sha256 == ref.sha256

    # one element of one base tensor changed: another base
    tensors = load_file(moved / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, moved / "model.safetensors", metadata={"format": "pt"})
    assert base_ref.fingerprint(moved).sha256 != ref.sha256


def test_a_changed_base_is_refused_in_one_line(base, tmp_path):
    ckpt = tmp_path / "step_00000001" / "actor"
    ckpt.mkdir(parents=True)
    assert base_ref.changed_base(ckpt, base, "model.path") is None  # a full checkpoint names no base
    recorded = base_ref.fingerprint(base)
    base_ref.write(ckpt, recorded)
    assert base_ref.read(ckpt) == recorded and base_ref.recorded_base(ckpt) == str(base.resolve())
    assert base_ref.changed_base(ckpt, base, "model.path") is None

    other = tmp_path / "other"
    shutil.copytree(base, other)
    tensors = load_file(other / "model.safetensors")
    name = sorted(tensors)[-1]
    tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    problem = base_ref.changed_base(ckpt, other, "model.path")
    assert problem is not None and "\n" not in problem
    now = base_ref.fingerprint(other)
    for part in (str(ckpt), str(base.resolve()), recorded.short(), str(other.resolve()), now.short(),
                 "set model.path to the original base weights", "trainer.resume=never"):
        assert part in problem, (part, problem)


def test_a_directory_without_weights_is_not_a_base(tmp_path):
    with pytest.raises(FileNotFoundError, match="no weight files"):
        base_ref.fingerprint(tmp_path)
