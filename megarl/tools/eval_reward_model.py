"""python -m megarl.tools.eval_reward_model --model HF_DIR --data PAIRS.parquet [--limit N]

A reward model's pairwise accuracy on preference pairs (prompt, chosen, rejected): the share of pairs whose
chosen answer scores higher. Each text is scored twice: by transformers (`AutoModelForSequenceClassification`,
what a user of the export runs) and by megarl (`reward.model_path`: megarl.rewards.model.RewardModel, one
process), on the same tokens (prompt + answer encoded once, as RewardModel encodes it). Prints one JSON line
{"pairwise_accuracy" (transformers'), "megarl_pairwise_accuracy", "max_abs_score_diff", "pairs"}.
"""
from __future__ import annotations

import argparse
import json
import sys


def score_pairs(model_dir: str, data_files: list[str], limit: int | None = None) -> dict:
    # deferred: torch, transformers and pyarrow (seconds to import): --help runs without them
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForSequenceClassification

    from megarl.data.tokenizer import load_tokenizer
    from megarl.distributed.parallel import dims_from_env
    from megarl.rewards.model import RewardModel

    rows = [r for path in data_files for r in pq.read_table(path, columns=["prompt", "chosen", "rejected"]).to_pylist()][:limit]
    prompts = [r["prompt"] for r in rows] * 2
    answers = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    tokenizer = load_tokenizer(model_dir, key="--model")
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.tensor([model(torch.tensor([tokenizer.encode(p + a)])).logits[0, 0].item()
                               for p, a in zip(prompts, answers)], dtype=torch.float64)
    dims = dims_from_env().initialize()
    ours = torch.tensor(RewardModel(model_dir, dims)(prompts, answers, [""] * len(prompts), [""] * len(prompts),
                                                     [{}] * len(prompts)), dtype=torch.float64)
    n = len(rows)
    return {"pairwise_accuracy": float((theirs[:n] > theirs[n:]).double().mean()),
            "megarl_pairwise_accuracy": float((ours[:n] > ours[n:]).double().mean()),
            "max_abs_score_diff": float((theirs - ours).abs().max()), "pairs": n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="pairwise accuracy of a reward model (transformers and megarl scores)")
    p.add_argument("--model", required=True, help="a *ForSequenceClassification directory (megarl.tools.export_hf of a reward model)")
    p.add_argument("--data", required=True, nargs="+", help="Parquet preference files (prompt, chosen, rejected)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N pairs")
    args = p.parse_args(argv)
    try:
        out = score_pairs(args.model, args.data, args.limit)
    except (ValueError, OSError, KeyError) as e:
        print(f"eval_reward_model: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
