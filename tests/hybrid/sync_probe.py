"""The probe-batch weight check (test support, not part of the step: the trainer compares the
engine's log-probs of its own samples instead, megarl.hybrid.verify.compare_logprobs)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from megarl.hybrid.verify import compare_logprobs
from megarl.rollout.base import RolloutEngine, RolloutRequest, SamplingParams, pad_results

ActorLogprobFn = Callable[[list[list[int]], list[list[int]]], list[torch.Tensor]]


def verify_sync(engine: RolloutEngine, probe_prompts: Sequence[Sequence[int]], actor_logprobs: ActorLogprobFn, *,
                max_new_tokens: int = 16, atol: float = 1e-2, stop_token_ids: Sequence[int] = ()) -> float:
    """Greedy-decode `probe_prompts` with the engine; compare with `actor_logprobs(prompts, responses)`.

    actor_logprobs returns, per sequence, the actor's log-softmax(logits) (temperature 1) of each
    response token, shape [len(response)]. Greedy requests report unscaled log-probs in every
    engine, so the two are comparable. Returns the max diff; raises WeightSyncMismatch.
    atol: bf16 engines differ from an fp32 actor by ~1e-2 in log-prob; fp32 on CPU by ~1e-5.
    """
    requests = [RolloutRequest(tuple(p), i) for i, p in enumerate(probe_prompts)]
    results = engine.generate(requests, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids)))
    batch = pad_results(results)
    actor = actor_logprobs([list(p) for p in probe_prompts], [r.response_token_ids for r in results])
    actor_padded = torch.zeros_like(batch.logprobs)
    for i, lp in enumerate(actor):
        if lp.numel() != len(results[i].response_token_ids):
            raise ValueError(f"actor_logprobs returned {lp.numel()} values for a response of {len(results[i].response_token_ids)} tokens")
        actor_padded[i, :lp.numel()] = lp.float().cpu()
    return compare_logprobs(batch.logprobs, actor_padded, batch.mask, atol)
