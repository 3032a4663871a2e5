"""The rollout engine contract: sampling parameters, requests, results, the engine Protocol.

Randomness is a function of (seed, step, global prompt index, sample index) only: every engine
expands `n` into `n` single-sample requests, each with the seed `make_sample_seed` gives it, so
what a sample is does not depend on the batch it was generated in, on the rank that generated it,
or on the rollout layout.
"""
from __future__ import annotations

import hashlib
import importlib
import struct
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Literal, Protocol, Sequence

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; one object per run (the per-sample seed is derived, not stored).

    n: samples per prompt. temperature: 0 means greedy. top_p: 1.0 disables nucleus sampling.
    top_k: 0 disables it. max_new_tokens: response length cap in tokens.
    stop_token_ids: generation of a sample stops after it emits one of these (the stop token is
        part of the response). Put the EOS id(s) here: megarl engines stop on nothing else, while
        vLLM also stops on the model's own EOS (see docs/rollout.md).
    banned_token_ids: tokens that are never sampled (greedy included), e.g. pad/bos/unk, which a
        policy could otherwise learn to emit. Part of the policy's definition: their logits are
        -inf before the softmax, so both processed and scaled log-probs renormalise without them,
        as the trainer's actor and reference do (docs/algorithms.md, "Banned tokens"). hf applies
        it in megarl.rollout.sampling, vLLM and SGLang through their logit_bias.
    seed: the run seed that `make_sample_seed` mixes with (step, prompt index, sample index).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "banned_token_ids", tuple(sorted({int(t) for t in self.banned_token_ids})))
        both = set(self.stop_token_ids) & set(self.banned_token_ids)
        if both:
            raise ValueError(f"SamplingParams: token ids {sorted(both)} are both stop tokens and banned; "
                             f"a banned stop token could never end a response")
        if any(t < 0 for t in self.banned_token_ids):
            raise ValueError(f"SamplingParams.banned_token_ids must be >= 0, got {list(self.banned_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def stop_token_ids(rollout, eos_token_id: int | None) -> tuple[int, ...]:
    """The tokens that end a response in every engine (each stops on exactly these, eos included
    only through this list): rollout.stop_token_ids, then eos unless rollout.ignore_eos
    (`rollout`: the config's rollout section)."""
    eos = () if rollout.ignore_eos or eos_token_id is None else (eos_token_id,)
    return tuple(rollout.stop_token_ids) + eos


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt. prompt_index is its index in the global batch of this step (layout independent).

    seed: when set, the one sample of this request (n must be 1) uses this seed instead of the
        one `make_sample_seed` derives; a multi-turn episode continues its sample with a seed per
        turn (megarl.rollout.multi_turn.turn_seed), whatever the engine.
    """

    prompt_token_ids: tuple[int, ...]
    prompt_index: int
    step: int = 0
    seed: int | None = None

    def __post_init__(self):
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"prompt {self.prompt_index} has no tokens")
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))


@dataclass
class RolloutResult:
    """One sampled response.

    logprobs: per response token, the log-prob under the distribution it was sampled from
        (temperature, top-k and top-p applied and renormalised; vLLM's "processed_logprobs").
        Greedy requests report log-softmax of the unscaled logits. SGLang cannot return this and
        reports scaled_logprobs here instead (docs/rollout.md has the table).
    scaled_logprobs: the same under softmax(logits / temperature) over the allowed vocabulary
        (banned tokens removed, as in logprobs) without top-k/top-p truncation: the quantity the
        actor recomputes, and the behaviour policy of the off-policy ratio (vLLM: processed + the
        log kept mass its KeptMassRecorder measured). None when the engine does not return it.
    routed_experts: MoE routing replay: the experts each token went to, [prompt + response - 1
        tokens, num_layers, topk] int16 (-1: dense layer / not routed; the last response token is
        never fed back). None unless the engine was asked to record (hf: `record_routes`).
    """

    prompt_index: int
    sample_index: int
    response_token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    scaled_logprobs: list[float] | None = None
    routed_experts: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # the policy version (trainer updates applied to the weights) each response token was sampled
    # under; None where the engine does not track versions (asynchronous training, megarl.async_rollout)
    versions: list[int] | None = field(default=None, compare=False)
    # Multi-turn episodes (megarl.rollout.multi_turn): 1 on the policy's tokens, 0 on the
    # environment's (their logprobs entries are 0); None = every token is the policy's.
    response_mask: list[int] | None = None
    # what the episode adds to the sample's score and its counts (turns, observations, failures)
    env_reward: float = 0.0
    episode: dict | None = field(default=None, compare=False)
    # rollout.placement=fleet: the server that generated it (megarl.rollout_side.fleet); None elsewhere
    server: str | None = field(default=None, compare=False)


class RolloutEngine(Protocol):
    """What the trainer needs from an inference engine colocated with training.

    Per step: `load_weights` (wakes weight memory, replaces all weights), `resume_memory`
    (KV cache back), `generate` (any number of times), `release_memory` (before training).
    """

    # MoE routing replay: set True and each result carries `routed_experts`. Engines that cannot
    # record keep False (config validation refuses actor.routing_replay with them).
    record_routes: bool

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """len(requests) * sampling.n results, prompt-major: result i*n + j is sample j of request i."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume a stream of full HF-checkpoint-named tensors (one pass, tensors not kept)."""
        ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    def close(self) -> None: ...


class EpisodeEngine(RolloutEngine, Protocol):
    """A RolloutEngine that runs rollout.multi_turn environment episodes (megarl.rollout.multi_turn
    `with_environment`: MultiTurnRollout, or separate placement's RemoteRollout, whose server runs them)."""

    # global prompt index -> the prompt's dataset row (what Environment.reset reads), set before generate
    rows: dict[int, dict]


_SEED_MASK = (1 << 63) - 1


def make_sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A stable 63-bit seed from (run seed, step, global prompt index, sample index) via BLAKE2b.

    Not Python's hash(): that is salted per process. 63 bits so every engine takes it (int64).
    """
    payload = struct.pack("<4q", seed, step, prompt_index, sample_index)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8, person=b"megarl-sample").digest(), "little") & _SEED_MASK


@dataclass(frozen=True)
class SampleSpec:
    """One row of work after expanding `n`: which request, which sample, and its seed."""

    request: RolloutRequest
    sample_index: int
    seed: int


def expand_samples(requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[SampleSpec]:
    """Expand each request into sampling.n single-sample rows, prompt-major, each with its own seed
    (a request's own seed when it carries one)."""
    if sampling.n != 1 and any(req.seed is not None for req in requests):
        raise ValueError("a RolloutRequest with its own seed is one sample: sampling.n must be 1")
    return [
        SampleSpec(req, j, req.seed if req.seed is not None else make_sample_seed(sampling.seed, req.step, req.prompt_index, j))
        for req in requests
        for j in range(sampling.n)
    ]


class MissingEngineError(ImportError):
    """An optional rollout engine is not installed."""

    def __init__(self, package: str, target_version: str, extra: str, cpu_hint: str | None = None):
        where = cpu_hint or f"{package} does not run on CPU; use rollout.engine=hf there"
        super().__init__(
            f"the '{package}' rollout engine needs {package}=={target_version}, which is not importable here. "
            f"Install it with `pip install 'megarl[{extra}]'` on a machine with CUDA ({where})."
        )


def import_engine(package: str, target_version: str, *, also_checked: tuple[str, ...] = (), cpu_hint: str | None = None):
    """`import <package>` (the extra of the same name), or a MissingEngineError naming the extra and
    the version megarl targets. The adapters follow that version's API exactly (and were also run
    against `also_checked`, e.g. a CPU build): any other installed version is said in a warning."""
    try:
        module = importlib.import_module(package)
    except ImportError as e:
        raise MissingEngineError(package, target_version, package, cpu_hint) from e
    installed = getattr(module, "__version__", "unknown")
    # local version labels ("0.32.0+cpu") name the build, not the API
    if installed.split("+")[0] not in (target_version, *also_checked):
        warnings.warn(
            f"megarl's {package} adapter targets {package}=={target_version} but {installed} is installed; "
            f"the calls it makes were checked against {', '.join((target_version, *also_checked))} only (docs/rollout.md lists them).",
            stacklevel=3,
        )
    return module


@dataclass
class ResponseBatch:
    """Results padded to a [num_samples, max_response_len] grid (right padding)."""

    token_ids: torch.Tensor  # [B, T] int64, pad 0
    logprobs: torch.Tensor  # [B, T] float32, pad 0
    mask: torch.Tensor  # [B, T] bool, True on response tokens
    prompt_index: torch.Tensor = field(default=None)  # [B]
    sample_index: torch.Tensor = field(default=None)  # [B]


def pad_results(results: Sequence[RolloutResult], use_scaled: bool = False) -> ResponseBatch:
    """Stack results into padded tensors; use_scaled picks scaled_logprobs instead of logprobs."""
    width = max((len(r.response_token_ids) for r in results), default=0)
    B = len(results)
    ids = torch.zeros(B, width, dtype=torch.long)
    lps = torch.zeros(B, width, dtype=torch.float32)
    mask = torch.zeros(B, width, dtype=torch.bool)
    for i, r in enumerate(results):
        T = len(r.response_token_ids)
        values = r.scaled_logprobs if use_scaled else r.logprobs
        if values is None:
            raise ValueError("pad_results(use_scaled=True) needs scaled_logprobs, which this engine did not return")
        ids[i, :T] = torch.tensor(r.response_token_ids, dtype=torch.long)
        lps[i, :T] = torch.tensor(values, dtype=torch.float32)
        mask[i, :T] = True
    return ResponseBatch(
        ids, lps, mask,
        torch.tensor([r.prompt_index for r in results], dtype=torch.long),
        torch.tensor([r.sample_index for r in results], dtype=torch.long),
    )
