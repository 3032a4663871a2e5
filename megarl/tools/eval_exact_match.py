"""python -m megarl.tools.eval_exact_match --model HF_DIR --data FILE.parquet [--run-config RUN/config.yaml] [--limit N]

Greedy exact-match accuracy of a model on a prompt dataset: a response counts when its tokens are
exactly the ground truth's tokens followed by eos (no extra, missing or special token; nothing is
decoded, so nothing can be hidden). Prints one JSON line {"exact_match", "correct", "total",
"examples"} with a few wrong answers shown as token strings.

The CPU demo's README figure is measured with it on the held-out split (`make demo-eval` exports the
last checkpoint with megarl.tools.export_hf first). Greedy = argmax over the vocabulary less the
model's generation_config.json suppress_tokens (as transformers' `generate` does; megarl.tools.export_hf
writes the run's rollout.banned_token_ids there, since a ban is part of the trained policy) and less
--banned-token-ids. --run-config / --banned-token-ids matter only for a model directory that does not
carry its bans (e.g. one exported before this was written).
"""
from __future__ import annotations

import argparse
import json
import sys

import yaml

from megarl import hub


def exact_match(model_dir: str, data_files: list[str], limit: int | None = None, max_new_tokens: int = 16,
                batch_rows: int = 256, banned_token_ids: tuple[int, ...] = ()) -> dict:
    """{"exact_match": fraction, "correct", "total", "examples": up to 5 wrong answers}."""
    # deferred: torch, transformers and pyarrow (seconds to import): --help runs without them
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.data.tokenizer import load_tokenizer

    from megarl.data.dataset import encode_prompt, read_prompt_files
    from megarl.rollout.base import RolloutRequest, SamplingParams
    from megarl.rollout.hf import HFRolloutEngine

    model_dir = hub.local_path(model_dir, "--model")  # a hub id: its snapshot in the Hugging Face cache
    tokenizer = load_tokenizer(model_dir, key="--model")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{model_dir}: the tokenizer has no eos token; exact match needs one to end answers")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    suppressed = getattr(model.generation_config, "suppress_tokens", None) or ()  # what `generate` would suppress
    banned_token_ids = tuple(sorted({*map(int, suppressed), *map(int, banned_token_ids)}))
    engine = HFRolloutEngine(model, device="cpu", max_batch_rows=batch_rows)
    rows = read_prompt_files(data_files)[:limit]
    requests = [RolloutRequest(tuple(encode_prompt(tokenizer, r["prompt"])), prompt_index=i) for i, r in enumerate(rows)]
    results = engine.generate(requests, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                                                       stop_token_ids=(tokenizer.eos_token_id,),
                                                       banned_token_ids=tuple(banned_token_ids)))
    correct, examples = 0, []
    for row, res in zip(rows, results):
        want = list(tokenizer.encode(row["ground_truth"], add_special_tokens=False)) + [tokenizer.eos_token_id]
        if list(res.response_token_ids) == want:
            correct += 1
        elif len(examples) < 5:
            examples.append({"prompt": row["prompt"], "want": tokenizer.convert_ids_to_tokens(want),
                             "got": tokenizer.convert_ids_to_tokens(list(res.response_token_ids))})
    return {"exact_match": correct / max(len(rows), 1), "correct": correct, "total": len(rows), "examples": examples}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="greedy exact-match accuracy (answer tokens then eos) of a HF model directory")
    p.add_argument("--model", required=True, help="a Hugging Face model directory (megarl.tools.export_hf writes one) or hub id (org/name[@revision])")
    p.add_argument("--data", required=True, nargs="+", help="Parquet prompt files (prompt, ground_truth columns)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--banned-token-ids", type=int, nargs="*", default=[],
                   help="never pick these tokens either (the model's generation_config suppress_tokens always apply)")
    p.add_argument("--run-config", help="a run's resolved config.yaml: take --banned-token-ids from its rollout.banned_token_ids")
    args = p.parse_args(argv)
    try:
        banned = list(args.banned_token_ids)
        if args.run_config:
            with open(args.run_config) as f:
                banned += list((yaml.safe_load(f).get("rollout") or {}).get("banned_token_ids") or [])
        out = exact_match(args.model, args.data, args.limit, args.max_new_tokens, banned_token_ids=tuple(banned))
    except (ValueError, OSError) as e:
        print(f"eval_exact_match: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
