"""MegatronEngine: the same update under every layout, checkpoint resharding, clipping, offload."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
LAYOUTS = {  # name: (processes, tp, pp, sequence parallelism)
    "tp2": (2, 2, 1, False),
    "pp2": (2, 1, 2, False),
    "dp2": (2, 1, 1, False),
    # sequence parallelism (megarl's default at tp > 1): tagged norms summed over TP, the value head's
    # gather, pipeline p2p of s/tp tokens
    "tp2xpp2_sp": (4, 2, 2, True),
}
REL_TOL = 1e-5


def _worker(tmp_path, model, nproc, *args) -> dict:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.pt"
    torchrun(nproc, ["tests/engine/engine_worker.py", "--model", str(model), "--out", str(out), *map(str, args)])
    return torch.load(out, weights_only=False)


def _max_rel_diff(a: dict, b: dict) -> float:
    """Largest element difference relative to the model's largest weight.

    Not per tensor: a weight whose gradient is exactly zero in exact arithmetic (the k-projection
    bias: softmax ignores a per-query constant) receives pure rounding noise, which Adam scales up
    to ~lr per element whatever the layout.
    """
    assert a.keys() == b.keys()
    scale = max(t.abs().max().item() for t in a.values())
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale


@pytest.fixture(scope="module")
def single_process(tiny_models, tmp_path_factory):
    return _worker(tmp_path_factory.mktemp("single"), tiny_models["qwen2"], 1, "--mode", "both")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_actor_and_critic_update_identical_across_layouts(layout, single_process, tiny_models, tmp_path):
    nproc, tp, pp, sp = LAYOUTS[layout]
    result = _worker(tmp_path, tiny_models["qwen2"], nproc, "--mode", "both", "--tp", tp, "--pp", pp, *(["--sp"] if sp else []))
    for role in ("actor", "critic"):
        ref, got = single_process[role], result[role]
        assert len(got["grad_norms"]) == 2  # two mini-batches -> two optimizer steps
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=REL_TOL)
        assert _max_rel_diff(ref["weights"], got["weights"]) <= REL_TOL, role
        for name, value in ref["metrics"].items():
            assert got["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-7), (role, name)
    # The update really changed the weights (a test that cannot fail would not).
    assert "score.weight" in single_process["critic"]["weights"]
    assert "lm_head.weight" not in single_process["critic"]["weights"]


def test_padded_micro_batches_give_the_packed_update(single_process, tiny_models, tmp_path):
    # Sequence packing is the default; padded rows (dp 2, so padding is agreed across ranks) must
    # produce the same update up to float rounding.
    padded = _worker(tmp_path, tiny_models["qwen2"], 2, "--mode", "both", "--packing", "off")
    for role in ("actor", "critic"):
        assert padded[role]["grad_norms"] == pytest.approx(single_process[role]["grad_norms"], rel=REL_TOL)
        assert _max_rel_diff(single_process[role]["weights"], padded[role]["weights"]) <= REL_TOL, role


def test_checkpoint_saved_under_one_layout_resumes_under_another(tiny_models, tmp_path):
    model = tiny_models["qwen2"]
    ckpt = tmp_path / "ckpt"
    _worker(tmp_path, model, 4, "--mode", "save", "--tp", 2, "--pp", 2, "--ckpt", ckpt)
    resumed = _worker(tmp_path, model, 2, "--mode", "resume", "--ckpt", ckpt)  # dp 2
    straight = _worker(tmp_path, model, 1, "--mode", "twice")
    assert resumed["grad_norms"] == pytest.approx(straight["grad_norms"][2:], rel=REL_TOL)
    assert _max_rel_diff(straight["weights"], resumed["weights"]) <= REL_TOL


def test_lora_checkpoint_saved_under_tp2_resumes_on_one_process(tiny_models, tmp_path):
    # Adapters only (megarl.engine.adapter_checkpoint): saved at tp2 with expert tp 2 (the TP-split
    # factors of attention, dense and expert layers described as shards of the global tensor), resumed
    # on one process: the second update equals two straight updates. Without the description the
    # load fails (each TP rank's shard was saved as the whole tensor).
    model, lora = tiny_models["qwen3_moe"], ("--lora-rank", 4)
    ckpt = tmp_path / "ckpt"
    _worker(tmp_path, model, 2, "--mode", "save", "--tp", 2, "--etp", 2, "--sp", "--ckpt", ckpt, *lora)
    keys = list(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert keys and all(".lora." in k for k in keys if "model." in k), keys  # no base weight
    resumed = _worker(tmp_path, model, 1, "--mode", "resume", "--ckpt", ckpt, *lora)
    straight = _worker(tmp_path, model, 1, "--mode", "twice", *lora)
    assert resumed["grad_norms"] == pytest.approx(straight["grad_norms"][2:], rel=REL_TOL)
    assert _max_rel_diff(straight["weights"], resumed["weights"]) <= REL_TOL  # merged weights: base + adapters


def test_checkpoint_across_an_expert_parallel_change_is_refused_in_one_line(tiny_models, tmp_path):
    # ep 2 -> ep 1: Megatron's optimizer keeps expert parameters apart only at ep > 1, so the load
    # fails deep inside DCP; the error names the two ep sizes and the fix, not "another architecture".
    model, ckpt = tiny_models["qwen3_moe"], tmp_path / "ckpt"
    _worker(tmp_path, model, 2, "--mode", "save", "--ep", 2, "--ckpt", ckpt)
    proc = torchrun(1, ["tests/engine/engine_worker.py", "--model", str(model), "--mode", "resume", "--ckpt", str(ckpt)],
                    check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "was written at parallel.ep=2 and this run has parallel.ep=1" in out, out[-3000:]
    assert "resume at parallel.ep > 1" in out and "another architecture" not in out


def test_grad_clip_uses_true_global_norm(tiny_models, tmp_path):
    result = _worker(tmp_path, tiny_models["llama"], 2, "--mode", "clip", "--tp", 2, "--max-grad-norm", 0.5, "--lr", 0.0)
    assert result["reported"] == pytest.approx(result["autograd"], rel=1e-5)
    assert result["reported"] > 0.5  # the limit is exceeded, so clipping must engage
    assert result["after_clip"] == pytest.approx(0.5, rel=1e-5)


def test_offload_round_trip_is_bit_identical(tiny_models, tmp_path):
    result = _worker(tmp_path, tiny_models["qwen2"], 1, "--mode", "offload")
    moved = result["moved_bytes"]
    # Adam keeps two fp32 moments per parameter (the DDP buffers also hold alignment padding).
    assert moved["params"] > 0 and moved["grads"] > 0 and moved["optimizer"] > 1.9 * moved["params"]
