"""The exported model is the policy that was trained (issue 21, item 1): a run's rollout.banned_token_ids
reach generation_config.json's suppress_tokens through the real export path (checkpoint ->
megarl.tools.export_hf), so plain transformers `generate` and megarl.tools.eval_exact_match without
any flag give what the run's own (banned) greedy decoding gives."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from conftest import REPO, make_model

MAX_NEW_TOKENS = 4


def _greedy(engine, prompts, eos, banned=()):
    from megarl.rollout.base import RolloutRequest, SamplingParams

    requests = [RolloutRequest(tuple(p), i) for i, p in enumerate(prompts)]
    results = engine.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(eos,),
                                                       banned_token_ids=tuple(banned)))
    return [list(r.response_token_ids) for r in results]


def _generate(model, prompts, **kw):
    """Plain transformers greedy decoding, one prompt at a time (no padding): the response tokens."""
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, **kw)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.slow  # a checkpoint save and an export process: about 40 s on a loaded 2-core machine
def test_exported_model_under_plain_generate_is_the_banned_policy(tmp_path, world_of_one, capsys):
    from transformers import AutoModelForCausalLM

    from megarl.config import load_config
    from megarl.config.loader import save_resolved
    from megarl.data.dataset import encode_prompt, read_prompt_files
    from megarl.data.prepare import prepare_arithmetic
    from megarl.data.tokenizer import load_tokenizer
    from megarl.engine.engine import EngineConfig, MegatronEngine
    from megarl.rollout.hf import HFRolloutEngine
    from megarl.tools.eval_exact_match import exact_match, main as eval_main

    # the demo's model family and task, random weights
    model_dir = make_model(tmp_path / "model", "llama", tokenizer="digits", tie=True, seed=3)
    data = prepare_arithmetic(tmp_path / "data", "copy", 3, 16, 32)["test"]
    tokenizer = load_tokenizer(str(model_dir))
    eos = tokenizer.eos_token_id
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in read_prompt_files([str(data)])]
    source = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    free = _greedy(source, prompts, eos)
    # ban the tokens the random model likes most (its unbanned greedy answers), as a run bans <pad>
    liked = Counter(t for answer in free for t in answer if t != eos)
    banned = sorted(t for t, _ in liked.most_common(3))
    trained = _greedy(source, prompts, eos, banned)  # the run's eval: greedy with its bans
    assert trained != free and not {t for a in trained for t in a} & set(banned)

    # a run directory as the trainer leaves it: resolved config.yaml and a checkpoint of the actor
    run = tmp_path / "run"
    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"),
                      [f"model.path={model_dir}", f"trainer.run_dir={run}", f"rollout.banned_token_ids={banned}"])
    run.mkdir()
    save_resolved(cfg, run / "config.yaml")
    ckpt = run / "checkpoints" / "step_00000001"
    MegatronEngine(str(model_dir), world_of_one, EngineConfig()).save(str(ckpt / "actor"))
    torch.save({}, ckpt / "trainer.pt")
    out = tmp_path / "hf"
    # a process of its own, as a user runs it (not this process's one-rank group and its port)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    export = subprocess.run([sys.executable, "-m", "megarl.tools.export_hf", "--ckpt", str(ckpt), "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=600, env={**env, "PYTHONPATH": str(REPO)})
    assert export.returncode == 0, export.stderr[-3000:]
    assert json.loads((out / "generation_config.json").read_text())["suppress_tokens"] == banned

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert _generate(exported, prompts) == trained  # plain generate: the trained (banned) policy
    assert _generate(exported, prompts, suppress_tokens=None) == free  # the weights alone: what users got before

    # the run's eval on the export: the same with no flag as with --run-config, and as with the bans by hand
    by_hand = exact_match(str(model_dir), [str(data)], max_new_tokens=MAX_NEW_TOKENS, banned_token_ids=tuple(banned))
    assert by_hand != exact_match(str(model_dir), [str(data)], max_new_tokens=MAX_NEW_TOKENS)  # bans change answers
    results = []
    for flags in ([], ["--run-config", str(run / "config.yaml")]):
        assert eval_main(["--model", str(out), "--data", str(data), "--max-new-tokens", str(MAX_NEW_TOKENS), *flags]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0] == results[1] == by_hand
