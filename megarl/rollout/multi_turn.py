"""Multi-turn rollouts, token in and token out: a RolloutEngine that runs one environment episode
per sample over any engine (hf, vLLM, SGLang) and returns each episode as one response.

    engine = MultiTurnRollout(engine, env_class, tokenizer, MultiTurnSettings(...))
    engine.rows = {prompt.global_index: prompt_row_dict, ...}     # what Environment.reset reads
    results = engine.generate(requests, sampling)                 # the RolloutEngine contract

Per turn, every live episode's whole sequence so far (prompt, then the response's token ids as
sampled and as appended) goes back to the engine as a token-id prompt: history is never decoded
and re-encoded, so the trainer's sequence is the one the engine conditioned on. The policy's
tokens carry mask 1 and the log-probs the engine sampled them with; the environment's text
(`reset`'s and every observation) is encoded once, appended with mask 0 and log-prob 0 (no loss,
no KL, no entropy; GAE carries across it). A final observation (done, max_turns, no budget left)
is not appended: nothing would read it.

Environment calls (construction + reset, then step) run on a megarl.agents.ToolExecutor:
concurrently across samples, at most max_concurrency at once, each for at most timeout_s; one
that raises, times out or returns a malformed value becomes an observation naming the failure
(counted in the episode), and the episode goes on.

Randomness: turn t of a sample samples with `turn_seed(sample seed, t)`, the sample seed being the
single-turn one, so an episode depends on (weights, prompt, seed, environment) only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch

from megarl.agents.chat import ChatTurns
from megarl.agents.environment import Turn, load_environment_class
from megarl.agents.tools import ToolExecutor
from megarl.rollout.base import (EpisodeEngine, RolloutEngine, RolloutRequest, RolloutResult, SampleSpec, SamplingParams,
                                 expand_samples, make_sample_seed)
from megarl.rewards.decode import response_text
from megarl.step.global_batch import LocalStats


@dataclass(frozen=True)
class MultiTurnSettings:
    """rollout.multi_turn: at most max_turns policy turns of at most max_tokens_per_turn tokens;
    the whole response (policy and environment tokens) at most max_total_tokens."""

    max_turns: int = 4
    max_tokens_per_turn: int = 128
    max_total_tokens: int = 512
    max_concurrency: int = 8
    timeout_s: float = 30.0

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_total_tokens", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.multi_turn.{name} must be >= 1, got {getattr(self, name)}")


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of turn `turn` of a sample (turn 0: the sample's own seed, as in a single turn)."""
    return sample_seed if turn == 0 else make_sample_seed(sample_seed, turn, -1, -1)


@dataclass
class _Episode:
    spec: SampleSpec
    env: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    scaled: list[float] | None = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    # the policy version each policy token was sampled under (None at environment tokens); None
    # when the engine does not track versions (asynchronous training, megarl.async_rollout)
    versions: list[int | None] | None = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    observations: int = 0  # environment turns appended (reset text excluded)
    errors: int = 0  # environment calls that raised or returned a malformed value
    timeouts: int = 0
    finish: str = "stop"
    done: bool = False
    last_turn: Turn | None = None
    # with a chat template: the conversation so far and the (name, tokens) segments of the sequence
    messages: list[dict] = field(default_factory=list)
    segments: list[tuple[str, int]] = field(default_factory=list)
    template_mismatch: int = 0

    def count(self, failure: str | None) -> None:
        self.errors += failure == "error"
        self.timeouts += failure == "timeout"

    def append(self, ids: Sequence[int], policy: bool, lps=None, scaled=None, versions=None) -> None:
        """Policy tokens with their engine log-probs (scaled ones and versions when the engine gave
        them: an episode keeps them only if every turn had them), or environment tokens (mask 0,
        log-prob 0)."""
        zeros = [0.0] * len(ids)
        if self.versions is not None:
            self.versions = None if policy and versions is None else self.versions + (list(versions) if policy else [None] * len(ids))
        self.tokens += list(ids)
        self.mask += [int(policy)] * len(ids)
        self.logprobs += list(lps) if policy else zeros
        if self.scaled is not None:
            self.scaled = None if policy and scaled is None else self.scaled + (list(scaled) if policy else zeros)


class MultiTurnRollout:
    """A RolloutEngine: `generate` runs episodes; weights and memory calls go to the wrapped engine."""

    def __init__(self, engine, env_class: Callable[[], Any], tokenizer, settings: MultiTurnSettings,
                 chat: ChatTurns | None = None, log: Callable[[str], None] | None = None):
        """chat: observations rendered by the tokenizer's chat template and every episode checked
        against it (megarl.agents.chat); log: where the check's one-line warning goes (None: nowhere)."""
        self.engine, self.env_class, self.tokenizer, self.settings = engine, env_class, tokenizer, settings
        self.chat, self.log = chat, log
        self.encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
        self.executor = ToolExecutor(settings.max_concurrency, settings.timeout_s)
        self.rows: dict[int, dict] = {}  # global prompt index -> dataset row, set before generate

    def use_rows(self, rows: dict[int, dict]) -> None:
        """The rows of the next generate's prompts: {global prompt index: row} (megarl.rollout.multi_turn.env_rows)."""
        self.rows = rows

    # the wrapped engine's weights, memory and options
    def load_weights(self, weights: Iterable) -> None:
        self.engine.load_weights(weights)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def close(self) -> None:
        self.engine.close()

    def __getattr__(self, name):  # use_direct_weights, describe_model, ... of the wrapped engine
        if "engine" not in self.__dict__:  # during unpickling / before __init__
            raise AttributeError(name)
        return getattr(self.__dict__["engine"], name)

    # ------------------------------------------------------------------ episodes
    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """len(requests) * n episodes, prompt-major, each as one RolloutResult with its response mask."""
        if self.engine.record_routes:
            raise ValueError("MoE routing replay (actor.routing_replay) is not supported with rollout.multi_turn")
        s = self.settings
        episodes = [_Episode(spec) for spec in expand_samples(requests, sampling)]
        self._start(episodes)
        turn = 0
        while live := [e for e in episodes if not e.done]:
            # one engine call per distinct token budget (the engine's context bound holds for each)
            by_budget: dict[int, list[_Episode]] = {}
            for e in live:
                by_budget.setdefault(min(s.max_tokens_per_turn, s.max_total_tokens - len(e.tokens)), []).append(e)
            for budget, group in by_budget.items():
                reqs = [RolloutRequest(e.spec.request.prompt_token_ids + tuple(e.tokens), e.spec.request.prompt_index,
                                       e.spec.request.step, seed=turn_seed(e.spec.seed, turn)) for e in group]
                results = self.engine.generate(reqs, replace(sampling, n=1, max_new_tokens=budget))
                for e, r in zip(group, results):
                    ids = list(r.response_token_ids)[:budget]
                    e.append(ids, True, r.logprobs[:len(ids)],
                             r.scaled_logprobs[:len(ids)] if r.scaled_logprobs is not None else None,
                             r.versions[:len(ids)] if r.versions is not None else None)
                    e.turns += 1
                    e.finish = r.finish_reason
                    e.last_turn = Turn(response_text(self.tokenizer, ids, sampling.stop_token_ids), tuple(ids), turn,
                                       r.finish_reason)
                    e.messages.append({"role": "assistant", "content": e.last_turn.text})
                    e.segments.append((f"assistant turn {turn}", len(ids)))
            self._step(live, turn)
            turn += 1
        if self.chat is not None:
            self._check_template(episodes)
        return [self._result(e) for e in episodes]

    def _check_template(self, episodes: list[_Episode]) -> None:
        """Each episode against the template's rendering of its conversation; one line when any differ."""
        checks = []
        for e in episodes:
            prompt = e.spec.request.prompt_token_ids
            check = self.chat.check(e.messages, list(prompt) + e.tokens, [("prompt", len(prompt)), *e.segments])
            e.template_mismatch = check.mismatched
            checks.append(check)
        bad = [c for c in checks if not c.ok]
        if bad and self.log is not None:
            self.log(f"megarl: {len(bad)} of {len(checks)} episodes differ from the chat template's rendering: {bad[0].warning()}")

    def _start(self, episodes: list[_Episode]) -> None:
        """Construct each sample's environment and reset it with its prompt's row (concurrently)."""
        def start(e: _Episode):
            row = dict(self.rows.get(e.spec.request.prompt_index, {}))
            e.messages = [{"role": "user", "content": str(row.get("prompt", ""))}]
            e.env = self.env_class()
            return e.env.reset(row)

        outcomes = self.executor.map([lambda e=e: start(e) for e in episodes])
        for e, o in zip(episodes, outcomes):
            text = o.value if o.ok else o.observation
            e.count(o.failure)
            if o.ok and text is not None and not isinstance(text, str):
                e.count("error")
                text = f"[tool error] reset returned {type(text).__name__}, not str or None"
            if text:  # plain encoding, also with a chat template: part of the prompt's user turn
                ids = self.encode(text)[: self.settings.max_total_tokens - 1]
                e.append(ids, False)
                e.segments.append(("reset text", len(ids)))
                if e.messages:
                    e.messages[-1]["content"] += text

    def _step(self, live: list[_Episode], turn: int) -> None:
        """Every live episode's environment reacts to its policy's turn (concurrently)."""
        s = self.settings
        outcomes = self.executor.map([lambda e=e: e.env.step(e.last_turn) for e in live])
        for e, o in zip(live, outcomes):
            observation, reward, done = _unpack(o)
            e.count(o.failure)
            if reward is None:  # malformed return value
                e.count("error")
                observation, reward, done = f"[tool error] step returned {o.value!r:.80}, not (observation, reward, done)", 0.0, False
            e.reward += reward
            left = s.max_total_tokens - len(e.tokens)
            if done or turn + 1 >= s.max_turns or left <= 0:
                e.done = True
                if left <= 0 and not done:
                    e.finish = "length"
                continue
            if observation:
                ids = (self.encode(observation) if self.chat is None else
                       self.chat.observation_ids(e.messages, e.last_turn.token_ids, observation))[:left]
                e.append(ids, False)
                e.observations += 1
                e.messages.append({"role": self.chat.role if self.chat else "tool", "content": observation})
                e.segments.append((f"tool turn {turn} (after assistant turn {turn})", len(ids)))
                if len(ids) == left:  # no room left for the policy
                    e.done, e.finish = True, "length"

    def _result(self, e: _Episode) -> RolloutResult:
        return RolloutResult(e.spec.request.prompt_index, e.spec.sample_index, e.tokens, e.logprobs, e.finish,
                             e.scaled, response_mask=e.mask, env_reward=e.reward,
                             episode={"turns": e.turns, "observations": e.observations, "errors": e.errors,
                                      "timeouts": e.timeouts, "template_mismatch": e.template_mismatch},
                             versions=_filled(e.versions))

    def metrics(self) -> dict[str, float]:
        """The executor's counts since construction (calls, errors, timeouts, abandoned)."""
        return self.executor.metrics()


def _filled(versions: list[int | None] | None) -> list[int] | None:
    """Per-token versions with each environment token given the version of the policy token before
    it (the first policy token's before any): the staleness of an episode is its policy tokens'."""
    if not versions or all(v is None for v in versions):
        return None
    last = next(v for v in versions if v is not None)
    out = []
    for v in versions:
        last = last if v is None else v
        out.append(last)
    return out


def _unpack(outcome) -> tuple[str | None, float | None, bool]:
    """(observation, reward, done) of a step's outcome; (None, None, False) for a malformed value
    (the caller names it); a failed call's observation with reward 0."""
    if not outcome.ok:
        return outcome.observation, 0.0, False
    value = outcome.value
    try:
        observation, reward, done = value
        reward = float(reward)
    except (TypeError, ValueError):
        return None, None, False
    if observation is not None and not isinstance(observation, str):
        return None, None, False
    return observation, reward, bool(done)


def with_environment(engine: RolloutEngine, rollout_cfg, tokenizer, log=None) -> RolloutEngine | EpisodeEngine:
    """The engine itself, or a MultiTurnRollout over it when rollout.multi_turn.environment is set
    (its class imported now: a bad name fails before any step). A remote engine (separate
    placement's RemoteRollout) is returned itself, set to send prompt rows: its server wraps the
    real engine with this same function."""
    mt = rollout_cfg.multi_turn
    if mt.environment is None:
        return engine
    env_class = load_environment_class(mt.environment)
    chat = ChatTurns(tokenizer) if mt.chat_template else None
    if getattr(engine, "remote_episodes", False):
        # rollout.placement=separate: the rollout rank runs the episodes beside its engine (one
        # round trip a step, and async.max_staleness keeps working); this side sends each prompt's
        # row with the prompts (megarl.async_rollout)
        engine.multi_turn, engine.chat = True, chat
        return engine
    total = mt.max_total_tokens or rollout_cfg.max_new_tokens
    settings = MultiTurnSettings(max_turns=mt.max_turns, max_tokens_per_turn=min(mt.max_tokens_per_turn or total, total),
                                 max_total_tokens=total, max_concurrency=mt.max_concurrency, timeout_s=mt.timeout_s)
    return MultiTurnRollout(engine, env_class, tokenizer, settings, chat, log)


def env_rows(prompts) -> dict[int, dict]:
    """{global prompt index: the row Environment.reset gets}: the dataset row's other columns, then
    prompt, ground_truth, data_source."""
    return {p.global_index: {**p.extra, "prompt": p.prompt, "ground_truth": p.ground_truth, "data_source": p.data_source}
            for p in prompts}


def episode_metrics(samples, engine, reduce) -> dict[str, float]:
    """The step's agents/* metrics over the global batch ({} when the samples are not episodes).
    `reduce`: GlobalBatch.reduce (a collective over the DP group: every rank calls this)."""
    if not (isinstance(engine, MultiTurnRollout) or getattr(engine, "multi_turn", False)):
        return {}  # (multi_turn: a remote engine whose rollout rank runs the episodes)
    col = lambda key: torch.tensor([float(s.episode[key]) for s in samples], dtype=torch.float64)  # noqa: E731
    stats = LocalStats()
    stats.mean("agents/turns_mean", col("turns"))
    stats.mean("agents/tool_call_rate", (col("observations") > 0).double())
    stats.mean("agents/observations_mean", col("observations"))
    stats.mean("agents/env_reward_mean", torch.tensor([s.env_reward for s in samples], dtype=torch.float64))
    stats.mean("agents/env_token_fraction", torch.tensor(
        [1.0 - sum(s.response_mask) / max(len(s.response_mask), 1) for s in samples], dtype=torch.float64))
    stats.sum("agents/env_errors", col("errors"))
    stats.sum("agents/env_timeouts", col("timeouts"))
    if engine.chat is not None:  # episodes whose tokens differ from the chat template's rendering
        stats.sum("agents/template_mismatch", (col("template_mismatch") > 0).double())
    return reduce(stats)
