"""A teacher for the distillation tests and the by-hand run (docs/algorithms.md, "On-policy
distillation"): a tiny Llama taught the demo's copy task by plain supervised next-token training
(transformers + torch, a few seconds), standing in for the pipeline's PPO export.

    python tests/trainer/distill_helpers.py OUT_DIR [--hidden 64 --layers 2 --steps 300]
"""
from __future__ import annotations

import argparse
from pathlib import Path


def supervised_copy_teacher(out: Path, hidden: int = 64, layers: int = 2, steps: int = 300, seed: int = 0,
                            batch_rows: int = 128, lr: float = 3e-3) -> Path:
    """A tiny random Llama (make_tiny_model, digits tokenizer) trained on "abc=" -> "abc" + eos with
    the loss on the answer tokens; written as an HF directory at `out` (once; reused if present)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.data.arithmetic import ArithmeticTask
    from megarl.data.dataset import encode_prompt
    from megarl.data.tokenizer import load_tokenizer
    from megarl.tools.make_tiny_model import make_tiny_model

    out = Path(out)
    if (out / "config.json").exists() and (out / "trained").exists():
        return out
    make_tiny_model("llama", out, seed=seed, tokenizer="digits", hidden=hidden, intermediate=4 * hidden, layers=layers,
                    heads=4, kv_heads=2, max_positions=64, init_std=0.02)
    tokenizer = load_tokenizer(str(out))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    task = ArithmeticTask(kind="copy", num_digits=3)
    g = torch.Generator().manual_seed(seed)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        numbers = torch.randint(0, 10 ** task.num_digits, (batch_rows,), generator=g).tolist()
        rows = [(encode_prompt(tokenizer, f"{n:03d}="),
                 tokenizer.encode(f"{n:03d}", add_special_tokens=False) + [tokenizer.eos_token_id]) for n in numbers]
        ids = torch.tensor([p + a for p, a in rows])  # every row has the same length: no padding
        labels = ids.clone()
        labels[:, : len(rows[0][0])] = -100  # loss on the answer and eos only
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.save_pretrained(out)
    (out / "trained").write_text(f"supervised copy, {steps} steps, final loss {loss.item():.4f}\n")
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    a = p.parse_args()
    print(supervised_copy_teacher(Path(a.out), hidden=a.hidden, layers=a.layers, steps=a.steps))
