"""Partial rollout on vLLM (async.partial_rollout): a weight update lands between two engine steps.

vLLM's `LLM.generate` runs its requests to the end, so with a `between_tokens` hook set the
adapter drives the engine itself (`LLMEngine.add_request` / `step`) and calls the hook after
every step, as the hf engine does after every token. When the hook loads newer weights
(`VLLMRolloutEngine.load_weights`), the running requests are aborted first (`interrupt`): each
keeps the tokens and log-probs it returned so far, the KV blocks computed under the old weights
are freed and the prefix cache emptied, the weights reloaded; then every interrupted request is
resubmitted as a continuation: prompt + its tokens so far as the prompt, the remaining
max_new_tokens, under the new weights (verl's and AReaL's abort-and-resume).

Unlike the hf engine, which keeps its KV cache across the update ("Magistral-style"), the kept
prefix is prefilled again under the new weights ("AReaL-style"): a continued token's log-prob is
exactly the new policy's given the whole prefix, what the trainer recomputes.

Seeds: a continuation cannot resume vLLM's per-request generator, and restarting it from the
sample's seed would reuse the noise that drew the first tokens (then the later tokens would
depend on the earlier ones' noise: a biased sample). It takes `continuation_seed(seed, kept)`, a
fresh stream that is a function of the sample's seed and how many tokens it kept, so a sample
is still a function of (weights and where they changed, prompt, seed); a request interrupted
before its first token keeps its own seed. Each token records the version of the weights that
computed it (RolloutResult.versions). vLLM tensor parallelism runs its ranks in lockstep, which
an abort on one rank would break: partial rollout on vLLM is rollout.tp 1 (megarl.async_rollout.placement).
"""
from __future__ import annotations

import hashlib
import importlib
import struct
from dataclasses import dataclass, field

from megarl.rollout.base import RolloutResult, SampleSpec, SamplingParams
from megarl.rollout.vllm_lora import AdapterSlot
from megarl.rollout.vllm_sampling import pop_kept_mass, scaled_logprobs, to_vllm_sampling, truncates

_SEED_MASK = (1 << 63) - 1


def continuation_seed(seed: int, kept: int) -> int:
    """The seed of a sample's continuation after `kept` tokens (the sample's own seed at 0)."""
    if kept == 0:
        return seed
    digest = hashlib.blake2b(struct.pack("<2q", seed, kept), digest_size=8, person=b"megarl-continue").digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


@dataclass
class _Sample:
    """One sample across its segments (one vLLM request per weights version it ran under)."""

    spec: SampleSpec
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    scaled: list[float] | None = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    request_id: str | None = None
    tag: str | None = None  # KeptMassRecorder's name for the running segment
    segment_start: int = 0  # tokens before the running segment


class InterruptibleGeneration:
    """One `generate` call under a `between_tokens` hook; `interrupt` is called by load_weights."""

    def __init__(self, engine, specs: list[SampleSpec], sampling: SamplingParams):
        self.engine, self.sampling = engine, sampling
        self.samples = [_Sample(s) for s in specs]
        self.running: dict[str, _Sample] = {}
        self.interrupted: list[_Sample] = []
        self.record = truncates(sampling) and engine.kept_mass  # scaled log-probs need the recorder
        self.call = engine._generate_calls
        self.segments = 0

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[RolloutResult]:
        llm_engine = self.engine.llm.llm_engine
        self._submit(self.samples)
        try:
            while self.running or self.interrupted:
                for out in llm_engine.step():
                    sample = self.running.get(out.request_id)
                    if sample is not None:
                        self._append(sample, out)
                if self.engine.between_tokens is not None:
                    self.engine.between_tokens()  # may load newer weights: interrupt() ran then
                if self.interrupted:
                    resume, self.interrupted = self.interrupted, []
                    self._submit(resume)
        finally:
            if self.running:  # an error mid-loop: leave no request of ours in the engine
                llm_engine.abort_request(list(self.running))
                self._close_segments(list(self.running.values()))
                self.running.clear()
        return [self._result(s) for s in self.samples]

    def interrupt(self) -> None:
        """Abort every running request (each keeps what it returned) before the weights change."""
        if not self.running:
            return
        stopped = list(self.running.values())
        self.engine.llm.llm_engine.abort_request(list(self.running))
        self.running.clear()
        self._close_segments(stopped)
        stop = set(self.sampling.stop_token_ids)
        for s in stopped:  # one that was complete but not yet reported finished needs no continuation
            if s.tokens and s.tokens[-1] in stop:
                s.finish = "stop"
            elif len(s.tokens) >= self.sampling.max_new_tokens:
                s.finish = "length"
            else:
                self.interrupted.append(s)

    # ------------------------------------------------------------------ helpers
    def _submit(self, samples: list[_Sample]) -> None:
        engine, vllm = self.engine, self.engine._vllm
        delta = importlib.import_module(vllm.__name__ + ".sampling_params").RequestOutputKind.DELTA
        prompts = [vllm.TokensPrompt(prompt_token_ids=list(s.spec.request.prompt_token_ids) + s.tokens) for s in samples]
        preprocess = getattr(engine.llm, "_preprocess_cmpl", None)  # LLM's own prompt rendering (no deprecation path)
        inputs = preprocess(prompts) if preprocess is not None else prompts
        lora = AdapterSlot.request_of(engine.adapter)
        for sample, prompt in zip(samples, inputs):
            self.segments += 1
            sample.segment_start = len(sample.tokens)
            sample.request_id = f"megarl-partial-{id(self)}-{self.call}-{self.segments}"
            sample.tag = sample.request_id if self.record else None
            params = to_vllm_sampling(vllm, self.sampling, continuation_seed(sample.spec.seed, len(sample.tokens)), sample.tag)
            params.max_tokens = self.sampling.max_new_tokens - len(sample.tokens)  # the total length stays the cap
            params.output_kind = delta  # the new tokens of each step (LLM.generate asks final only)
            engine.llm.llm_engine.add_request(sample.request_id, prompt, params, lora_request=lora)
            self.running[sample.request_id] = sample

    def _append(self, sample: _Sample, out) -> None:
        c = out.outputs[0]
        new = list(c.token_ids)
        if new and c.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs; SamplingParams.logprobs=0 should always return the sampled token's")
        sample.tokens += new
        sample.logprobs += [float(c.logprobs[j][tok].logprob) for j, tok in enumerate(new)]
        sample.versions += [self.engine.version] * len(new)
        if out.finished:
            sample.finish = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
            del self.running[sample.request_id]
            self._close_segments([sample])

    def _close_segments(self, samples: list[_Sample]) -> None:
        """The scaled log-probs of each sample's segment that just ended."""
        records = pop_kept_mass([s.tag for s in samples])
        for s in samples:
            processed = s.logprobs[s.segment_start:]
            if s.scaled is None:
                continue
            if s.tag is not None:
                part = scaled_logprobs(processed, records.get(s.tag))
            else:  # nothing truncates: one distribution; truncated without a recorder: unknown
                part = None if truncates(self.sampling) else list(processed)
            s.scaled = None if part is None else s.scaled + part

    def _result(self, s: _Sample) -> RolloutResult:
        spec = s.spec
        return RolloutResult(spec.request.prompt_index, spec.sample_index, s.tokens, s.logprobs, s.finish or "abort",
                             scaled_logprobs=s.scaled, versions=s.versions)
