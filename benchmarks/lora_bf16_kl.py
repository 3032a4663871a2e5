"""python benchmarks/lora_bf16_kl.py --out benchmarks/results/lora_bf16_kl_cpu.json [--preset small]

How far each way of handing LoRA weights to a bf16 rollout engine moves the policy away from the
one the trainer computes (issue 26: a peer measured mean train/rollout KL 0.051 with merged bf16
weights against 0.0020 adapter-only).

A random Llama (transformers, built here from a config, seeded; bf16) gets train-like adapters on
every decoder linear: A drawn as PEFT draws it, B random, scaled so that ||scale * B @ A||_F is
`rel` of ||W||_F (after training, not PEFT's B = 0). A and B are rounded to bf16, because that is
what megarl's trainer holds: `megarl.models.lora.LoraAdapter` makes its factors in the weight's dtype
(the optimizer's float32 main copy stays in the optimizer).

The training policy is megarl's own adapter forward: a real `LoraAdapter` on each HF linear, run by
megarl's forward hook (`lora._hook`: the base matmul in bf16 plus `delta(x)`, the low-rank path in
the factors' dtype, added in bf16). `--also-fp32-lowrank` adds a second reference with the low-rank
path in float32 (float32 factors, as a trainer without bf16 adapter parameters would compute it).

Rollout policies, each teacher-forced on the same tokens:
  bf16_merge       W_bf16 + (scale * B @ A).to(bf16), the add in bf16: merging into bf16 weights,
                   what the peers' users did (PEFT's merge on bf16 weights rounds the same way)
  fp32_merge_cast  megarl.models.lora.merged_weight: W.float() + weight_delta() in float32, then cast to
                   bf16 (megarl's full-weight fallback, `merged_shards`)
  adapter_only     bf16 base, adapters unmerged, applied as vLLM's CPU LoRA ops do (torch_ops: shrink
                   x @ A^T into a float32 buffer, expand in bf16 with B pre-multiplied by scale)
  base_only        the adapters dropped (for scale: how far the adapters move the policy at all)
and, for scale, the floor that bf16 arithmetic itself sets: KL(train in bf16 || the same bf16-valued
weights and factors computed in float32).

Tokens: `rows` responses of `tokens` tokens sampled (temperature 1) from the training policy after a
random prompt; the per-position KL(rollout || train) over the whole vocabulary is taken at every
response position. The LM head is multiplied by `--logit-scale` so the policy is peaked like a
trained LM's (the training policy's mean entropy is recorded): a 0.02-std random head gives near
uniform next-token distributions, in which any weight error reads as a tiny KL.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from megarl.models import lora  # noqa: E402

PRESETS = {  # hidden, intermediate, layers, heads, kv_heads, vocab (as benchmarks/_common.py's)
    "tiny": (64, 128, 2, 4, 2, 301),
    "small": (256, 704, 4, 8, 4, 4096),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = ("bf16_merge", "fp32_merge_cast", "adapter_only", "base_only")


def build_model(preset: str, seed: int, logit_scale: float):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = PRESETS[preset]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         max_position_embeddings=256, initializer_range=0.02, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.to(torch.bfloat16)


def attach_adapters(model, seed: int, rank: int, alpha: float, rel: float) -> dict:
    """A megarl LoraAdapter on every decoder linear, its factors set to train-like values.
    Returns name -> linear (each with `.lora` and the float32 factors in `.lora_fp32`)."""
    options = lora.LoraOptions(rank=rank, alpha=alpha)
    g = torch.Generator().manual_seed(10_000 + seed)
    linears = {}
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in PROJECTIONS]
    for name, module in targets:
        proj = name.rsplit(".", 1)[-1]
        module.parallel_mode = "column"  # one process: the kind only decides how TP would shard
        out, inp = module.weight.shape
        adapter = lora.LoraAdapter(module, (proj,), "one", {proj}, [out], inp, options, name, None)
        a = (torch.rand(rank, inp, generator=g) * 2 - 1) / math.sqrt(inp)  # PEFT's A
        b = torch.randn(out, rank, generator=g)
        # scale B so the update is `rel` of the weight, as after some training (PEFT starts at B = 0)
        b *= rel * module.weight.detach().float().norm() / (options.scale * (b @ a).norm())
        with torch.no_grad():
            part = adapter.adapters[proj]
            part.lora_A.copy_(a)  # rounded to bf16: the trainer's parameters are in the weight's dtype
            part.lora_B.copy_(b)
        module.lora = adapter
        module.lora_fp32 = (a, b)
        module.mode = "train"
        module.register_forward_hook(_dispatch)
        linears[name] = module
    return linears


def _vllm_delta(module, x: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU LoRA (lora/ops/torch_ops): shrink into a float32 buffer, expand in the model
    dtype with lora_b pre-multiplied by the scale at load time."""
    part = next(iter(module.lora.adapters.values()))
    h = x.float() @ part.lora_A.float().t()
    b_scaled = (part.lora_B * module.lora.scale).to(x.dtype)
    return h.to(x.dtype) @ b_scaled.t()


def _dispatch(module, args, output):
    if module.mode == "train":  # megarl's training forward (bf16 factors)
        return lora._hook(module, args, output)
    if module.mode == "train_fp32_lowrank":
        a, b = module.lora_fp32
        return output + (F.linear(F.linear(args[0].float(), a), b) * module.lora.scale).to(output.dtype)
    if module.mode == "adapter_only":
        return output + _vllm_delta(module, args[0])
    return output  # merged weights, or the base alone


def set_policy(linears: dict, base: dict, policy: str) -> None:
    """Load the weights and forward mode of one policy into every adapted linear."""
    with torch.no_grad():
        for name, m in linears.items():
            m.weight.copy_(base[name])
            if policy in ("train", "train_fp32_lowrank", "adapter_only", "base_only"):
                m.mode = policy
                continue
            m.mode = "merged"
            if policy == "fp32_merge_cast":
                m.weight.copy_(lora.merged_weight(m))  # megarl's merge, from the bf16 base and factors
            elif policy == "bf16_merge":
                m.weight.add_(m.lora.weight_delta().to(torch.bfloat16))  # delta rounded, then a bf16 add
            else:
                raise ValueError(policy)


def update_lost(linears: dict, base: dict, policy: str) -> float:
    """||merged - (W + delta)||_F / ||delta||_F summed over the adapted weights: the share of the
    update that the hand-over's rounding changes (float64 truth from the bf16 base and factors)."""
    err = ref = 0.0
    for name, m in linears.items():
        delta = m.lora.weight_delta().double()
        got = m.weight.double() - base[name].double()
        err += (got - delta).pow(2).sum().item()
        ref += delta.pow(2).sum().item()
    return math.sqrt(err / ref)


def measure(preset: str = "small", seed: int = 0, rank: int = 16, alpha: float = 32.0, rel: float = 0.03,
            logit_scale: float = 20.0, prompt: int = 8, tokens: int = 64, rows: int = 4,
            also_fp32_lowrank: bool = False) -> dict:
    model = build_model(preset, seed, logit_scale)
    linears = attach_adapters(model, seed, rank, alpha, rel)
    base = {name: m.weight.detach().clone() for name, m in linears.items()}
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(20_000 + seed)
    prompt_ids = torch.randint(0, vocab, (rows, prompt), generator=g)

    set_policy(linears, base, "train")
    with torch.no_grad():
        ids = prompt_ids
        for _ in range(tokens):  # sampled from the training policy, temperature 1, no cache (small)
            logits = model(ids).logits[:, -1].float()
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
            ids = torch.cat([ids, nxt], 1)

    def logprobs(policy: str) -> torch.Tensor:
        set_policy(linears, base, policy)
        with torch.no_grad():
            out = model(ids).logits[:, prompt - 1:-1].float()
        return torch.log_softmax(out, -1)  # [rows, tokens, vocab]: the response positions

    refs = ["train"] + (["train_fp32_lowrank"] if also_fp32_lowrank else [])
    ref_lp = {r: logprobs(r) for r in refs}
    train = ref_lp["train"]
    set_policy(linears, base, "train")
    with torch.no_grad():  # the same (bf16-valued) weights and factors, computed in float32
        fp32 = torch.log_softmax(copy.deepcopy(model).float()(ids).logits[:, prompt - 1:-1], -1)
    floor = (train.exp() * (train - fp32)).sum(-1).clamp_min(0)
    result = {
        "seed": seed, "rel_update": rel,
        "train_entropy_mean": float(-(train.exp() * train).sum(-1).mean()),
        "update_lost": {},
        "kl_bf16_compute_vs_fp32_compute": {"mean": float(floor.mean()), "max": float(floor.max())},
        "kl": {r: {} for r in refs},
    }
    for variant in VARIANTS:
        lp = logprobs(variant)
        if variant in ("bf16_merge", "fp32_merge_cast"):
            result["update_lost"][variant] = update_lost(linears, base, variant)
        for r, ref in ref_lp.items():
            kl = (lp.exp() * (lp - ref)).sum(-1).clamp_min(0)  # KL(rollout || train) per position
            result["kl"][r][variant] = {"mean": float(kl.mean()), "max": float(kl.max())}
    if also_fp32_lowrank:
        lp = ref_lp["train_fp32_lowrank"]
        kl = (lp.exp() * (lp - train)).sum(-1).clamp_min(0)
        result["kl_fp32_lowrank_vs_bf16_lowrank"] = {"mean": float(kl.mean()), "max": float(kl.max())}
    return result


def summarise(runs: list[dict], refs: list[str]) -> dict:
    out = {}
    for rel in sorted({r["rel_update"] for r in runs}):
        rs = [r for r in runs if r["rel_update"] == rel]
        row = {"train_entropy_mean": sum(r["train_entropy_mean"] for r in rs) / len(rs),
               "bf16_compute_floor_mean_kl": sum(r["kl_bf16_compute_vs_fp32_compute"]["mean"] for r in rs) / len(rs)}
        for ref in refs:
            row[ref] = {v: {"mean_kl": sum(r["kl"][ref][v]["mean"] for r in rs) / len(rs),
                            "max_kl": max(r["kl"][ref][v]["max"] for r in rs)} for v in VARIANTS}
        row["update_lost"] = {v: sum(r["update_lost"][v] for r in rs) / len(rs) for v in ("bf16_merge", "fp32_merge_cast")}
        out[str(rel)] = row
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rel", type=float, nargs="+", default=[0.01, 0.03, 0.05],
                   help="||scale * B @ A||_F / ||W||_F of every adapted weight")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--logit-scale", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--also-fp32-lowrank", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    from _common import write_result

    torch.set_num_threads(args.threads)
    runs = [measure(args.preset, seed, args.rank, args.alpha, rel, args.logit_scale, tokens=args.tokens, rows=args.rows,
                    also_fp32_lowrank=args.also_fp32_lowrank) for rel in args.rel for seed in args.seeds]
    refs = ["train"] + (["train_fp32_lowrank"] if args.also_fp32_lowrank else [])
    hidden, inter, layers, heads, kv, vocab = PRESETS[args.preset]
    result = {
        "what": "per-token KL(rollout || train) over the vocabulary of a bf16 policy with LoRA, by weight hand-over",
        "model": {"family": "llama (transformers, random, seeded)", "hidden": hidden, "intermediate": inter, "layers": layers,
                  "heads": heads, "kv_heads": kv, "vocab": vocab, "dtype": "bfloat16", "logit_scale": args.logit_scale},
        "lora": {"rank": args.rank, "alpha": args.alpha, "targets": list(PROJECTIONS), "factors": "bf16 (megarl's parameters)"},
        "tokens_per_run": args.rows * args.tokens, "seeds": args.seeds,
        "command": "python benchmarks/lora_bf16_kl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "peer_reference": {"mean_kl_merged_bf16": 0.051, "mean_kl_adapter_only": 0.0020,
                           "note": "trained 8B-class policy; sources in ../shared/notes/async-rl.md"},
        "summary_by_rel_update": summarise(runs, refs),
        "runs": runs,
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
