"""Rollout tp2 from 4-process training layouts with real vLLM (not in `make test`: four vLLM
engines cost minutes on 2 cores). Runs tests/vllm/sync_worker.py on 4 processes: two TP2 engines
(ranks 0-1, 2-3), train tp4 / tp2 x pp2 / tp2 x dp2 / dp4, each synced by the direct path and
compared with transformers on the exported actor as test_sync_layouts.py does:

    HF_HUB_OFFLINE=1 PYTHONPATH=$PWD .venv-vllm/bin/python tests/vllm/four_process_parity.py qwen2   # or llama
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_worker import PROMPTS  # noqa: E402
from vllm_models import greedy, make_vllm_model, teacher_forced_logprobs, transformers_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="megarl_four_"))
    arch = sys.argv[1]
    model = make_vllm_model(tmp / arch, arch=arch, heads=8, kv_heads=4, hidden=256)
    out = tmp / f"results-{arch}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "tests/vllm/sync_worker.py",
           "--model", str(model), "--rollout-tp", "2", "--layouts", "4,1", "2,2", "2,1", "1,1", "--out", str(out), "--tmp", str(tmp), "--corrupt"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if p.returncode:
        print((p.stdout + p.stderr)[-5000:])
        sys.exit(1)
    for r in json.loads(out.read_text()):
        ref = transformers_model(Path(r["export"]))
        assert r["weight_path"] == "direct", r["weight_path"]
        for g in r["per_rank"]:
            assert g["needed_bytes"] == g["vllm_shard_bytes"] and g["bound_bytes"] <= g["bytes_received"] <= 1.05 * g["bound_bytes"], g
        worst = 0.0
        for rank, got in enumerate(r["per_rank"]):
            for pr, toks, lps in zip(PROMPTS, got["tokens"], got["logprobs"]):
                assert toks == greedy(ref, pr, 8), (r["tp"], r["pp"], rank)
                worst = max(worst, max(abs(a - b) for a, b in zip(lps, teacher_forced_logprobs(ref, pr, toks))))
        print(arch, f"train tp{r['tp']} pp{r['pp']} dp{r['dp']} -> rollout tp2 x2 engines:", r["weight_path"], "greedy == transformers on 4 ranks,",
              f"max |dlogprob| {worst:.2e}; bytes", [g["bytes_received"] for g in r["per_rank"]], "bound", [g["bound_bytes"] for g in r["per_rank"]],
              "shard==vllm", all(g["needed_bytes"] == g["vllm_shard_bytes"] for g in r["per_rank"]))


if __name__ == "__main__":
    main()
