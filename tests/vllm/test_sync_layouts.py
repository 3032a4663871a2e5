"""Real vLLM behind the HybridEngine under torchrun on 2 processes: after each sync from a
Megatron actor in layout train tp2 / pp2 / dp2, greedy output equals transformers on the exported
actor and the log-probs are at float32 noise, for rollout tp 2 (one engine over both ranks,
external_launcher over gloo) and rollout tp 1 (two independent replicas).

The sync is the direct path (megarl.rollout.vllm_direct): each rank receives exactly its rollout
shard (the bytes of vLLM's own parameters on it), at the bound (its rollout shard minus what it
holds: zero for train tp2 -> rollout tp2), and writes it into vLLM's sharded parameters. A
corrupted shard (one rank's down_proj slice x1.5) is caught by the trainer's sync check."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_models import greedy, make_vllm_model, teacher_forced_logprobs, transformers_model

from megarl.hybrid.verify import WeightSyncMismatch, check_sync

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LAYOUTS = ["2,1", "1,2", "1,1"]  # train tp2, pp2, dp2 (= tp1) on 2 ranks
LOGPROB_ATOL = 1e-4


# Each family's own part of the direct path: llama's tied lm_head (the embedding, repacked with it),
# qwen2's qkv bias (de-interleaved like the weight) and untied lm_head, qwen3's q/k norms.
@pytest.mark.parametrize("rollout_tp,arch", [(2, "llama"), (2, "qwen2"), (1, "qwen3")],
                         ids=["rollout-tp2-llama", "rollout-tp2-qwen2", "two-tp1-replicas-qwen3"])
def test_resync_from_every_train_layout_matches_transformers(tmp_path, rollout_tp, arch):
    model = make_vllm_model(tmp_path / arch, arch=arch)
    out = tmp_path / "results.json"
    # two tp1 replicas sync by delta (rollout.weight_sync.mode=delta): a full sync, a step of the
    # actor, then only the changed elements; vLLM must hold what transformers computes on the export
    delta = rollout_tp == 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "tests/vllm/sync_worker.py", "--model", str(model), "--rollout-tp", str(rollout_tp),
           "--layouts", *LAYOUTS, "--out", str(out), "--tmp", str(tmp_path), "--corrupt",
           "--weight-sync", "delta" if delta else "full"]
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    results = json.loads(out.read_text())
    assert [(r["tp"], r["pp"]) for r in results] == [(2, 1), (1, 2), (1, 1)]
    for r in results:
        where = f"train tp{r['tp']} pp{r['pp']} dp{r['dp']} -> rollout tp{rollout_tp}"
        assert r["weight_path"] == "direct", where
        assert r["rollout_group"] == ([0, 1] if rollout_tp == 2 else [0])  # rank 0's engine instance
        for rank, got in enumerate(r["per_rank"]):
            # exactly vLLM's shard arrives on the rank, and only what the rank did not hold crosses the wire
            assert got["needed_bytes"] == got["vllm_shard_bytes"], f"{where}, rank {rank}"
            assert got["bound_bytes"] <= got["bytes_received"] <= 1.05 * got["bound_bytes"], f"{where}, rank {rank}: {got}"
            if delta and got["bytes_received"]:  # fp32: a tenth of the elements moved, the rest stayed home
                assert got["went_as_delta"] and 0.05 < got["changed_fraction"] < 0.2, f"{where}, rank {rank}: {got}"
                assert got["delta_bytes"] < 0.6 * got["bytes_received"], f"{where}, rank {rank}: {got}"
        if r["pp"] == 1 and r["tp"] in (1, rollout_tp):  # the rank holds its rollout shard, but for the vocabulary
            want = [_vocab_boundary_bytes(rank, r["tp"], rollout_tp, tied=arch == "llama") for rank in range(2)]
            assert [got["bytes_received"] for got in r["per_rank"]] == want, where
        else:
            assert all(got["bytes_received"] > 0 for got in r["per_rank"]), where
        ref = transformers_model(Path(r["export"]))
        want = [greedy(ref, p, 8) for p in _prompts()]
        for rank, got in enumerate(r["per_rank"]):
            assert got["tokens"] == want, f"{where}, rank {rank}"
            for p, toks, lps in zip(_prompts(), got["tokens"], got["logprobs"]):
                expected = teacher_forced_logprobs(ref, p, toks)
                assert max(abs(a - b) for a, b in zip(lps, expected)) < LOGPROB_ATOL, f"{where}, rank {rank}"
    # three different actors: each sync really replaced the weights
    assert len({json.dumps(r["per_rank"][0]["tokens"]) for r in results}) == 3
    # The corrupted shard (rank 1's, first layout, before its correct sync) is caught by the
    # trainer's check on every rank of the engine that holds it: both ranks of the TP2 engine,
    # only rank 1 with two TP1 replicas (rank 0's replica got correct weights and passes).
    first = results[0]
    ref = transformers_model(Path(first["export"]))
    for rank, got in enumerate(first["per_rank"]):
        bad = got["corrupted"]
        engine_lp = torch.tensor([lp for lps in bad["logprobs"] for lp in lps])[None]
        actor_lp = torch.tensor([lp for p, toks in zip(_prompts(), bad["tokens"]) for lp in teacher_forced_logprobs(ref, p, toks)])[None]
        mask = torch.ones_like(engine_lp, dtype=torch.bool)
        if rollout_tp == 2 or rank == 1:
            with pytest.raises(WeightSyncMismatch, match="float32"):
                check_sync(engine_lp, actor_lp, mask, "float32", where="rollout.engine=vllm")
        elif not delta:  # under delta the export holds the actor after its step; this snapshot predates it
            check_sync(engine_lp, actor_lp, mask, "float32")


def _vocab_boundary_bytes(rank: int, train_tp: int, rollout_tp: int, tied: bool) -> int:
    """Hand-worked: the vocabulary (301 rows of 128 floats) is split at different rows by the
    trainer (Megatron pads it to a multiple of tp: 302 rows at tp2, shard boundary at row 151)
    and by vLLM (pads to 64: 320 rows, boundary at 160). Train tp2 -> rollout tp2: rank 0 needs
    rows 151-159, which rank 1 holds; rank 1 needs 160-300, which it holds. Same split (tp1): 0."""
    if train_tp == 1 or rollout_tp == 1:
        return 0
    rows = 9 if rank == 0 else 0
    return rows * 128 * 4 * (1 if tied else 2)


def _prompts():
    from sync_worker import PROMPTS

    return PROMPTS
