"""Write a tiny random-initialised Hugging Face model directory (config, weights, tokenizer).

    python -m megarl.tools.make_tiny_model --arch qwen2 --out /tmp/tiny-qwen2 [--seed 0]
    python -m megarl.tools.make_tiny_model --arch deepseek_v3 --out /tmp/tiny-dsv3 [--q-lora-rank 0] [--groups 2]
    python -m megarl.tools.make_tiny_model --arch glm4_moe --out /tmp/tiny-glm [--mtp-layers 1]

Tests and the CPU demo build every model they use with this tool: nothing is downloaded from a
model hub. The result loads with `transformers.AutoModelForCausalLM` and `AutoTokenizer`.

Two tokenizers: `bpe` is a small byte-level BPE trained on a built-in corpus (any text encodes);
`digits` has one token per character of a small alphabet (digits and a few symbols) and suits the
arithmetic demo task, where a tiny vocabulary makes learning from scratch fast.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
import torch

from megarl.models.families import FAMILY_NAMES, LARGE_MOE_FAMILIES

ARCHS = FAMILY_NAMES  # every family megarl builds (megarl.models.families)
DIGITS_ALPHABET = list("0123456789+-*=;:?# ")
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]

_BPE_CORPUS = """
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May? #### 72
Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) . , ? !
Let's think step by step. The answer is 42. Question: Answer: Therefore the total is
"""


def build_tokenizer(kind: str, out: Path, bpe_vocab_size: int = 300):
    """Create and save a tokenizer; returns the `PreTrainedTokenizerFast`."""
    from transformers import PreTrainedTokenizerFast  # deferred: transformers (seconds to import) loads only when this runs

    if kind == "digits":
        vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + DIGITS_ALPHABET)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        # Every character is its own token; decoding concatenates them back.
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
    elif kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=bpe_vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([_BPE_CORPUS] * 4, trainer=trainer)
    else:
        raise ValueError(f"unknown tokenizer {kind!r}; choose 'bpe' or 'digits'")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(out)
    return fast


def build_config(arch: str, vocab_size: int, args: argparse.Namespace):
    """A small `transformers` config of the given family."""
    import transformers  # deferred: transformers (seconds to import) loads only when this runs

    common = dict(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=args.tie,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if args.head_dim is not None:
        common["head_dim"] = args.head_dim
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)  # q/k/v projections carry a bias
    if arch == "qwen3":
        common.setdefault("head_dim", 2 * args.hidden // args.heads)  # explicit, != hidden/heads
        return transformers.Qwen3Config(**common)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=args.experts, num_experts_per_tok=args.topk)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            num_experts=args.experts,
            num_experts_per_tok=args.topk,
            moe_intermediate_size=args.intermediate // 2,
            norm_topk_prob=True,
        )
    if arch in LARGE_MOE_FAMILIES:
        if args.experts % args.groups or args.experts // args.groups < 2:
            raise ValueError(f"--experts {args.experts} must split into --groups {args.groups} groups of at least 2 experts")
        if args.dense_layers >= args.layers:
            raise ValueError(f"--dense-layers {args.dense_layers} must be smaller than --layers {args.layers}")
        moe = dict(
            n_routed_experts=args.experts,
            num_experts_per_tok=args.topk,
            moe_intermediate_size=args.intermediate // 2,
            n_shared_experts=1,
            n_group=args.groups,
            topk_group=args.topk_group,
            first_k_dense_replace=args.dense_layers,
            routed_scaling_factor=2.5,  # not 1: a dropped scaling shows in the parity tests
            norm_topk_prob=True,
            num_nextn_predict_layers=args.mtp_layers,
        )
    if arch == "deepseek_v3":
        common["num_key_value_heads"] = args.heads  # MLA: one key/value per query head
        common.pop("head_dim", None)
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if args.yarn_factor:
            # DeepSeek-V3's own yarn settings, scaled down: a longer context than "pretraining" had
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": args.yarn_factor, "beta_fast": 32, "beta_slow": 1,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": args.max_positions // 4}
        return transformers.DeepseekV3Config(
            **common, **moe,
            q_lora_rank=args.q_lora_rank or None,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=20,  # != the q/k head size 16 + 8: MLA's separate k/v head sizes
            rope_parameters=rope,
        )
    if arch == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common, **moe,
            attention_bias=True,
            use_qk_norm=args.qk_norm,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    raise ValueError(f"unknown --arch {arch!r}; supported: {', '.join(ARCHS)}")


def _add_mtp_layers(out: Path, num_layers: int, count: int) -> None:
    """Append multi-token-prediction layers as DeepSeek-V3 / GLM-4.5 checkpoints carry them
    (`model.layers.{num_layers + i}`: a decoder layer plus enorm, hnorm, eh_proj, shared_head);
    transformers does not build them, megarl skips them on load."""
    path = out / "model.safetensors"
    tensors = load_file(path)
    last = f"model.layers.{num_layers - 1}."
    gen = torch.Generator().manual_seed(num_layers)
    for i in range(count):
        prefix = f"model.layers.{num_layers + i}."
        for name, t in list(tensors.items()):
            if name.startswith(last):
                tensors[prefix + name[len(last):]] = torch.randn(t.shape, generator=gen).to(t.dtype)
        h = tensors["model.norm.weight"].shape[0]
        for extra, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                             ("shared_head.norm.weight", (h,))):
            tensors[prefix + extra] = torch.randn(shape, generator=gen)
    save_file(tensors, str(path), metadata={"format": "pt"})


def make_tiny_model(arch: str, out: str | Path, seed: int = 0, **overrides) -> Path:
    """Python entry point; keyword overrides match the CLI flags (hidden=, layers=, tokenizer=, ...)."""
    args = _parser().parse_args(["--arch", arch, "--out", str(out), "--seed", str(seed)])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise ValueError(f"make_tiny_model has no option {key!r}")
        setattr(args, key, value)
    return _make(args)


def _make(args: argparse.Namespace) -> Path:
    from transformers import AutoModelForCausalLM  # deferred: transformers (seconds to import) loads only when this runs

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(args.tokenizer, out, args.bpe_vocab_size)
    vocab_size = args.vocab_size or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"--vocab-size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = build_config(args.arch, vocab_size, args)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # transformers' init (std 0.02, zero biases, unit norms) would let a converter that drops
        # a bias or a norm weight pass parity tests; every tensor gets its own random values.
        for name, p in model.named_parameters():
            p.normal_(0.0, args.init_std)
            if "norm" in name:
                p.add_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a zero bias would not show a dropped one
                b.normal_(0.0, 0.5)  # the scale of sigmoid scores: it changes many choices
    model.save_pretrained(out)
    if args.mtp_layers:
        _add_mtp_layers(out, config.num_hidden_layers, args.mtp_layers)
    (out / "megarl_tiny.json").write_text(json.dumps(vars(args), indent=1, default=str))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=("bpe", "digits"), default="bpe")
    p.add_argument("--bpe-vocab-size", type=int, default=300)
    p.add_argument("--vocab-size", type=int, default=None, help="model vocabulary (default: the tokenizer's size)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.add_argument("--init-std", type=float, default=0.1)
    moe = p.add_argument_group("deepseek_v3 / glm4_moe")
    moe.add_argument("--q-lora-rank", type=int, default=32, help="deepseek_v3: 0 = no q compression (q_lora_rank null)")
    moe.add_argument("--kv-lora-rank", type=int, default=32)
    moe.add_argument("--yarn-factor", type=float, default=None, help="deepseek_v3: YaRN rope scaling with this factor")
    moe.add_argument("--groups", type=int, default=2, help="n_group: expert groups for group-limited routing")
    moe.add_argument("--topk-group", type=int, default=1, help="topk_group: groups each token may use")
    moe.add_argument("--dense-layers", type=int, default=1, help="first_k_dense_replace")
    moe.add_argument("--mtp-layers", type=int, default=0, help="multi-token-prediction layers to append to the checkpoint")
    moe.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=True, help="glm4_moe: use_qk_norm")
    return p


def main(argv=None) -> int:
    try:
        out = _make(_parser().parse_args(argv))
    except ValueError as err:
        print(f"make_tiny_model: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
