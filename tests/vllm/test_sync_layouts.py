"""Real vLLM behind the HybridEngine under torchrun on 2 processes: after each sync from a
Megatron actor in layout train tp2 / pp2 / dp2, greedy output equals transformers on the exported
actor and the log-probs are at float32 noise, for rollout tp 2 (one engine over both ranks,
external_launcher over gloo) and rollout tp 1 (two independent replicas)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_models import greedy, make_vllm_model, teacher_forced_logprobs, transformers_model

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LAYOUTS = ["2,1", "1,2", "1,1"]  # train tp2, pp2, dp2 (= tp1) on 2 ranks
LOGPROB_ATOL = 1e-4


@pytest.mark.parametrize("rollout_tp", [2, 1], ids=["rollout-tp2", "two-tp1-replicas"])
def test_resync_from_every_train_layout_matches_transformers(tmp_path, rollout_tp):
    model = make_vllm_model(tmp_path / "llama")
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "tests/vllm/sync_worker.py", "--model", str(model), "--rollout-tp", str(rollout_tp),
           "--layouts", *LAYOUTS, "--out", str(out), "--tmp", str(tmp_path)]
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    results = json.loads(out.read_text())
    assert [(r["tp"], r["pp"]) for r in results] == [(2, 1), (1, 2), (1, 1)]
    for r in results:
        where = f"train tp{r['tp']} pp{r['pp']} dp{r['dp']} -> rollout tp{rollout_tp}"
        # a rank receives what it does not hold: nothing when it trains a whole replica (dp2)
        assert (r["sync_bytes"] > 0) == (r["tp"] * r["pp"] > 1), where
        assert r["rollout_group"] == ([0, 1] if rollout_tp == 2 else [0])  # rank 0's engine instance
        ref = transformers_model(Path(r["export"]))
        want = [greedy(ref, p, 8) for p in _prompts()]
        for rank, got in enumerate(r["per_rank"]):
            assert got["tokens"] == want, f"{where}, rank {rank}"
            for p, toks, lps in zip(_prompts(), got["tokens"], got["logprobs"]):
                expected = teacher_forced_logprobs(ref, p, toks)
                assert max(abs(a - b) for a, b in zip(lps, expected)) < LOGPROB_ATOL, f"{where}, rank {rank}"
    # three different actors: each sync really replaced the weights
    assert len({json.dumps(r["per_rank"][0]["tokens"]) for r in results}) == 3


def _prompts():
    from sync_worker import PROMPTS

    return PROMPTS
