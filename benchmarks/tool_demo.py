"""python benchmarks/tool_demo.py --out benchmarks/results/tool_demo.json [--seeds 1,2] [--nproc 2] [--run-root DIR]

The tool demo (configs/tiny_cpu_tool.yaml) as a user runs it (torchrun, 2 CPU processes), one run
per seed, then measured: greedy episodes on the held-out keys with the last checkpoint (exported
to a Hugging Face directory, the run's banned tokens applied), through the same multi-turn rollout
and environment the run trained with. An episode counts as exact when its first turn is a lookup
("?") and its final turn is the value's tokens then eos, nothing else.

Writes {"config", "runs": [{"seed", "steps", "exact_match", "eval_tool_call_rate", "tool_call_rate_first5",
"tool_call_rate_last5", "tool_call_rate_by_step", "score_by_step", "entropy_by_step", "examples", "train_wall_s",
"load_average_min/mean/max"}]}. A benchmark, not a
test: a run takes tens of minutes on 2 shared cores (tests/agents and tests/trainer/test_multi_turn_run.py
check the machinery).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_cpu_tool.yaml"


def train(seed: int, run_root: Path, nproc: int) -> tuple[Path, dict]:
    """The run's directory and the machine's 1-minute load average over the run (sampled every 10 s:
    the cores are shared, so the run's pace says little without it)."""
    run_dir = run_root / f"seed{seed}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "launch" / "ppo.py"), "--config", str(REPO / CONFIG), f"trainer.seed={seed}", f"trainer.run_dir={run_dir}",
           "tracking.loggers=[jsonl]", "tracking.progress_bar=false"]
    started, loads = time.monotonic(), []
    proc = subprocess.Popen(cmd, cwd=run_root, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    while proc.poll() is None:
        loads.append(os.getloadavg()[0])
        time.sleep(10)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return run_dir, {"train_wall_s": round(time.monotonic() - started), "load_average_min": round(min(loads, default=0.0), 1),
                     "load_average_mean": round(sum(loads) / max(len(loads), 1), 1), "load_average_max": round(max(loads, default=0.0), 1)}


def evaluate(run_dir: Path, data_file: Path, cwd: Path, max_rows: int | None = None) -> dict:
    """Greedy exact match of the last checkpoint's episodes on `data_file` (see module doc);
    `cwd`: where the run was started (its config's relative paths)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.agents.lookup import LookupTool
    from megarl.config import load_config
    from megarl.data.dataset import encode_prompt, read_prompt_files
    from megarl.data.tokenizer import load_tokenizer
    from megarl.rollout.base import RolloutRequest, SamplingParams
    from megarl.rollout.hf import HFRolloutEngine
    from megarl.rollout.multi_turn import MultiTurnRollout, MultiTurnSettings
    from megarl.rollout.base import stop_token_ids

    cfg = load_config(str(run_dir / "config.yaml"), [])
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    hf_dir = run_dir / "hf_last"
    subprocess.run([sys.executable, "-m", "megarl.tools.export_hf", "--ckpt", str(last), "--out", str(hf_dir)], check=True, cwd=cwd,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    tokenizer = load_tokenizer(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    mt = cfg.rollout.multi_turn
    episodes = MultiTurnRollout(HFRolloutEngine(model, max_batch_rows=256), LookupTool, tokenizer,
                                MultiTurnSettings(mt.max_turns, mt.max_tokens_per_turn, mt.max_total_tokens))
    rows = read_prompt_files([str(data_file)])[:max_rows]
    episodes.rows = dict(enumerate(rows))
    requests = [RolloutRequest(tuple(encode_prompt(tokenizer, r["prompt"])), prompt_index=i) for i, r in enumerate(rows)]
    eos = tokenizer.eos_token_id
    results = episodes.generate(requests, SamplingParams(n=1, temperature=0.0, max_new_tokens=mt.max_total_tokens,
                                                         stop_token_ids=stop_token_ids(cfg.rollout, eos),
                                                         banned_token_ids=tuple(cfg.rollout.banned_token_ids)))
    exact, called, examples = 0, 0, []
    question = tokenizer.convert_tokens_to_ids("?")
    for row, r in zip(rows, results):
        mask, ids = r.response_mask, r.response_token_ids
        last_env = max((i for i, m in enumerate(mask) if m == 0), default=-1)
        final = ids[last_env + 1:]
        want = list(tokenizer.encode(row["ground_truth"], add_special_tokens=False)) + [eos]
        did_call = bool(ids) and ids[0] == question and r.episode["observations"] > 0
        called += did_call
        if did_call and final == want:
            exact += 1
        elif len(examples) < 5:
            examples.append({"prompt": row["prompt"], "want": row["ground_truth"], "got": tokenizer.convert_ids_to_tokens(ids)})
    return {"exact_match": exact / max(len(rows), 1), "eval_tool_call_rate": called / max(len(rows), 1), "total": len(rows),
            "examples": examples, "checkpoint": last.name}


def run_metrics(run_dir: Path) -> dict:
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
    rate = [round(r["agents/tool_call_rate"], 4) for r in rows]
    return {"steps": len(rows), "tool_call_rate_first5": sum(rate[:5]) / 5, "tool_call_rate_last5": sum(rate[-5:]) / 5,
            "tool_call_rate_by_step": rate, "score_by_step": [round(r["critic/score/mean"], 4) for r in rows],
            "entropy_by_step": [round(r["actor/entropy"], 4) for r in rows],
            "val_score_by_step": {r["step"]: round(r["val/score/mean"], 4) for r in rows if "val/score/mean" in r}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", default="1")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--run-root", default="runs/tool_demo_bench")
    p.add_argument("--eval-only", action="store_true", help="measure existing runs under --run-root")
    args = p.parse_args(argv)
    root = Path(args.run_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    out = {"config": CONFIG, "runs": []}
    for seed in map(int, args.seeds.split(",")):
        run_dir, load = (root / f"seed{seed}", {}) if args.eval_only else train(seed, root, args.nproc)
        data = root / "runs" / "data" / "lookup" / "test.parquet"  # data.auto_prepare wrote it under the run's cwd
        out["runs"].append({"seed": seed, **run_metrics(run_dir), **evaluate(run_dir, data, root), **load})
        print(json.dumps({k: v for k, v in out["runs"][-1].items() if not k.endswith("_by_step")}), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
