"""rollout.placement=separate with real vLLM (tests/vllm/separate_worker.py under torchrun): training
ranks at train tp2 stream the actor to rollout ranks that run only vLLM, and each rollout rank
receives exactly its rollout shard, the bound for two disjoint groups (it holds nothing, so the
bound is its whole shard), which is exactly the bytes of vLLM's own parameters on it. Greedy
output from the rollout ranks then equals transformers on the exported actor."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_models import greedy, make_vllm_model, teacher_forced_logprobs, transformers_model

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LOGPROB_ATOL = 1e-4


def shard_bytes(rollout_tp: int, q: int) -> int:
    """Hand-worked rollout shard of the tiny tied llama (vllm_models.VLLM_TINY: hidden 128, ffn 256,
    2 layers, 4 heads and 2 kv heads of 32) on rollout TP rank q, float32. Per layer: qkv (4+2+2)
    x 32 x 128, o_proj 128 x 128, gate_up 2 x 256 x 128, down 128 x 256, split over rollout tp, two
    norms of 128 whole; the final norm whole; the embedding (also the tied lm_head, sent once):
    vLLM pads 301 rows to 320 and splits those evenly, rows [160q, 160q + 160) cut at 301."""
    split = 8 * 32 * 128 + 128 * 128 + 2 * 256 * 128 + 128 * 256
    rows = 301 if rollout_tp == 1 else min(160 * (q + 1), 301) - 160 * q
    return 4 * (2 * (split // rollout_tp + 2 * 128) + 128 + rows * 128)


FOUR_PROCESSES = os.environ.get("MEGARL_VLLM_FOUR_PROCESS") == "1"


def launch(tmp: Path, rollout_tp: int) -> list[dict]:
    """tests/vllm/separate_worker.py on 2 training ranks + rollout_tp rollout ranks; each rank's record."""
    world = 2 + rollout_tp
    model = make_vllm_model(tmp / "llama")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "tests/vllm/separate_worker.py", "--model", str(model), "--rollout-tp", str(rollout_tp), "--tmp", str(tmp)]
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=1200, env=env)
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


# rollout tp2 is one vLLM engine over two rollout ranks: four processes (two Megatron, two vLLM),
# minutes on 2 shared cores, so outside `make test`; MEGARL_VLLM_FOUR_PROCESS=1 runs it.
@pytest.mark.parametrize("rollout_tp", [1, pytest.param(2, marks=pytest.mark.skipif(
    not FOUR_PROCESSES, reason="4 processes (2 vLLM TP ranks): set MEGARL_VLLM_FOUR_PROCESS=1"))],
    ids=["train-tp2-to-rollout-tp1", "train-tp2-to-rollout-tp2"])
def test_separate_rollout_ranks_receive_their_shard_and_match_transformers(tmp_path, rollout_tp):
    ranks = launch(tmp_path, rollout_tp)
    train, rollout = ranks[:2], ranks[2:]
    for r in rollout:
        q = (r["rank"] - 2) % rollout_tp
        assert r["weight_path"] == "direct", r
        assert r["engine_ranks"] == list(range(2 + (r["rank"] - 2) // rollout_tp * rollout_tp, 2 + ((r["rank"] - 2) // rollout_tp + 1) * rollout_tp))
        # the bound for disjoint groups is the whole rollout shard; it is what arrives, and it is vLLM's parameters
        assert r["bound_bytes"] == r["shard_bytes"] == shard_bytes(rollout_tp, q), r
        assert r["payload_bytes"] == r["shard_bytes"] == r["vllm_shard_bytes"], r
        # on the wire each chunk starts 8-byte aligned: an odd number of float32 gets 4 bytes of padding
        assert r["shard_bytes"] <= r["sync_bytes"] <= r["shard_bytes"] + 4 * r["chunks_received"], r
    # the training ranks sent what the rollout ranks received, nothing more
    assert sum(t["bytes_sent"] for t in train) == sum(r["sync_bytes"] for r in rollout)
    ref = transformers_model(Path(train[0]["export"]))
    from separate_worker import PROMPTS

    want = [greedy(ref, p, 8) for p in PROMPTS]
    for t in train:
        assert t["weight_path"] == "direct" and t["layout_tp"] == rollout_tp
        assert t["server"] == 2  # the engine's first rank serves; with tp2 the second follows it
        assert t["tokens"] == want, f"training rank {t['rank']}"
        assert all(v == [0] * len(toks) for v, toks in zip(t["versions"], t["tokens"]))  # the pushed version 0
        for p, toks, lps in zip(PROMPTS, t["tokens"], t["logprobs"]):
            assert max(abs(a - b) for a, b in zip(lps, teacher_forced_logprobs(ref, p, toks))) < LOGPROB_ATOL
