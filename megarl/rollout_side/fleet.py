"""rollout.placement=fleet: rollout servers outside the torchrun world generate; they join, leave and
fail while training goes on (docs/rollout.md, "Fleet").

Rank 0 of the training job opens the fleet endpoint (megarl.fleet.endpoint); servers join with
`python -m megarl.rollout.serve`. `FleetEngine` stands where the colocated engine stands: the
3D-HybridEngine streams the actor's full HF tensors into its `load_weights`, which publishes them
from rank 0 to every server as the next weights version, and its `submit` / `collect` hand a batch
of requests, each with its samples' seeds, to the servers holding that version and wait for them.
`FleetRollout` is the side: every training rank's prompts through rank 0, the results and the
fleet's metrics back; under async.max_staleness K it submits the steps up to K ahead, so the
servers generate them while the trainer trains (the staleness bound as under separate placement,
megarl.async_rollout.staleness).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from megarl.async_rollout.staleness import StalenessStats, is_fresh
from megarl.fleet.endpoint import FleetEndpoint, WaitStopped
from megarl.fleet.wire import DTYPE_NAMES
from megarl.rollout.base import RolloutRequest, RolloutResult, SamplingParams, expand_samples
from megarl.platform.process_groups import all_gather_object
from megarl.rollout_side.base import StepSamples, WeightHandOver
from megarl.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, installed_watch
from megarl.step.samples import Sample


def _signalled() -> bool:
    """A SIGTERM / SIGUSR1 reached this process during the training loop (its preemption watch)."""
    watch = installed_watch()
    return watch is not None and watch.received is not None


def run_token(token_file: str, run_dir: str, log=print) -> str:
    """The run's token: rollout.fleet.token_file's content (relative paths under trainer.run_dir),
    created with a fresh random token, readable by its owner only, when missing."""
    path = Path(token_file) if os.path.isabs(token_file) else Path(run_dir) / token_file
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"rollout.fleet.token_file {path} is empty: delete it (a fresh token is written) or put the "
                             f"run's token in it") from None
        return token
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log(f"megarl fleet: wrote a new run token to {path} (servers need a copy: --token-file)")
    return token


class FleetEngine:
    """The trainer's handle on the fleet, as a RolloutEngine: weights out, results in. Only rank 0
    holds the endpoint (`endpoint` None elsewhere); the other ranks consume the weight stream, which
    is collective, and reach the fleet through rank 0 (`FleetRollout`)."""

    def __init__(self, endpoint: FleetEndpoint | None, min_servers: int):
        self.endpoint, self.min_servers = endpoint, min_servers
        self.version = 0  # the last weights version published: FleetRollout.hand_over's step
        self.policy: dict[int, int] = {}  # weights version -> the updates before those weights (every rank)
        self._next_policy = 0
        self.record_routes = False

    def number_from(self, step: int, policy: int) -> None:
        """The next weights version is at least `step`: a new version at every hand-over and never
        below the step's number, so a step's samples carry version `step` (validation's hand-over
        after it takes the next number), also after a trainer restarted from a checkpoint, whose
        first hand-over would otherwise be version 1. policy: the updates before these weights."""
        self.version = max(self.version, step - 1)
        self._next_policy = policy

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """The stream's full HF tensors to every server as the next weights version (from rank 0)."""
        self.version += 1
        self.policy[self.version] = self._next_policy
        if self.endpoint is None:
            return {name for name, _ in weights}
        # publish copies each tensor into the weights buffer as the stream yields it (the stream may
        # reuse its buffers): no copy here
        return self.endpoint.publish(self.version, weights)

    def submit(self, requests: list[RolloutRequest], sampling: SamplingParams):
        """len(requests) * n samples to generate, each seeded as the colocated engine seeds it (rank 0):
        a handle for `collect`."""
        if not requests:
            return None
        specs = expand_samples(requests, sampling)
        rows = [{"prompt_index": req.prompt_index, "prompt_ids": list(req.prompt_token_ids),
                 "seeds": [s.seed for s in specs[i * sampling.n:(i + 1) * sampling.n]]} for i, req in enumerate(requests)]
        wire_sampling = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p), "top_k": int(sampling.top_k),
                         "max_new_tokens": int(sampling.max_new_tokens), "stop_token_ids": list(sampling.stop_token_ids),
                         "banned_token_ids": list(sampling.banned_token_ids)}
        return requests, self.endpoint.submit(requests[0].step, rows, wire_sampling, self.min_servers)

    def collect(self, handle) -> list[RolloutResult]:
        """A submitted batch's results, prompt-major (rank 0; waits)."""
        if handle is None:
            return []
        requests, job = handle
        answers = self.endpoint.collect(job, stop=_signalled)
        results = []
        for i, req in enumerate(requests):
            answer = answers[i]
            for sample in sorted(answer.samples, key=lambda s: s["sample_index"]):
                tokens = sample["token_ids"]
                results.append(RolloutResult(req.prompt_index, sample["sample_index"], tokens, sample["logprobs"],
                                             sample["finish_reason"], sample["scaled_logprobs"] or None,
                                             versions=list(sample["versions"]), server=answer.server_id))
        return results

    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """`submit` and `collect` at once (rank 0)."""
        return self.collect(self.submit(requests, sampling))

    def metrics(self) -> dict[str, float]:
        return self.endpoint.stats.metrics()

    def release_memory(self) -> None:
        pass

    def resume_memory(self) -> None:
        pass


class FleetRollout:
    """The fleet side. Every training rank calls `samples` / `generate` together: the first rank of
    each model-parallel group puts its DP batch's requests in, rank 0 hands all of them to the fleet,
    and every rank takes its prompts' results back (with rank 0's fleet/ metrics).

    Under async.max_staleness K > 0 step t's prompts are drawn and submitted at step t - K, with the
    weights published then, so the servers generate steps ahead while the trainer trains; a sample
    older than K updates when its step trains (none is, unless its weights lagged) is dropped with
    its prompt group and generated again with the current weights. With async.partial_rollout the
    servers load new weights between the tokens of a running request, and a sample's age counts
    from its oldest token. A checkpoint records the data's
    position before the prompts in flight: a resume draws them again, none is lost or trained twice."""

    def __init__(self, engine: FleetEngine, weight_path: str, hand_over: WeightHandOver, dispatch, data,
                 sampling: SamplingParams, to_samples, world_size: int, max_staleness: int = 0, total_steps: int = 0):
        self.engine, self.weight_path, self._hand_over = engine, weight_path, hand_over
        self.dispatch, self.data, self.sampling, self._to_samples = dispatch, data, sampling, to_samples
        self.world_size, self.max_staleness, self.total_steps = world_size, max_staleness, total_steps
        self._metrics: dict[str, float] = {}
        self._handed_step = 0
        self.in_flight: dict[int, tuple[list, object]] = {}  # step -> (this rank's prompts, rank 0's handle)
        self.data_states: dict[int, dict] = {}  # step -> the data's position before its prompts were drawn

    def hand_over(self, step: int):
        # the weights of step `step` come after step - 1 updates; a second hand-over within a step
        # (validation's) comes after its update
        policy = step if step == self._handed_step else step - 1
        self._handed_step = step
        self.engine.number_from(step, policy)
        return self._hand_over(self.engine)

    def samples(self, step: int) -> StepSamples:
        if not self.max_staleness:
            samples = self.generate(self.data.next_step(), self.sampling, step)
            return StepSamples(samples, metrics=dict(self._metrics))
        for t in range(step, min(step + self.max_staleness, self.total_steps) + 1):  # the steps ahead
            if t not in self.in_flight:
                self.data_states[t] = self.data.state_dict()
                prompts = self.data.next_step()
                self.in_flight[t] = (prompts, self._submit(prompts, self.sampling, t))
        prompts, handle = self.in_flight.pop(step)
        self.data_states.pop(step, None)
        results = self._results(step, handle)
        stats = StalenessStats()
        stale = {r.prompt_index for r in results if r.versions and not is_fresh(
            step, self.engine.policy[min(r.versions)], self.max_staleness)}
        if stale:  # every rank sees every result: the same groups everywhere, generated again together
            stats.dropped = sum(1 for r in results if r.prompt_index in stale)
            again = self._results(step, self._submit([p for p in prompts if p.global_index in stale], self.sampling, step))
            results = [r for r in results if r.prompt_index not in stale] + again
        for r in results:
            if r.versions:  # under async.partial_rollout a sample's tokens may span versions
                stats.add(step, [self.engine.policy[v] for v in r.versions])
        metrics = {**self._metrics, **stats.metrics()}
        return StepSamples(self._mine(prompts, results, self.sampling), metrics=metrics,
                           current_weights=not stats.staleness_max)

    def generate(self, prompts, sampling: SamplingParams, step: int) -> list[Sample]:
        """sampling.n responses to each of this DP rank's prompts, prompt-major (collective over the
        training ranks: a rank without prompts still calls it)."""
        return self._mine(prompts, self._results(step, self._submit(prompts, sampling, step)), sampling)

    def _submit(self, prompts, sampling: SamplingParams, step: int):
        """Every rank's prompts to the fleet (collective); rank 0's handle on them (None elsewhere)."""
        mine = [RolloutRequest(tuple(p.prompt_ids), prompt_index=p.global_index, step=step) for p in prompts]
        # the ranks of a model-parallel group hold the same prompts: its first rank speaks for it
        shares = all_gather_object(mine if self.dispatch.mp_rank == 0 else [], self.world_size, None)
        if self.engine.endpoint is None:
            return None
        return self.engine.submit([r for share in shares for r in share], sampling)

    def _results(self, step: int, handle) -> list:
        """A submission's results, all ranks' (collective: rank 0 waits for them and hands them on,
        with the fleet's metrics and its wait)."""
        payload: list = [None]
        if self.engine.endpoint is not None:  # rank 0
            start = time.perf_counter()
            try:
                results = self.engine.collect(handle)
                metrics = {**self.engine.metrics(), "async/trainer_wait_s": time.perf_counter() - start}
                payload = [("samples", results, metrics)]
            except WaitStopped as stopped:
                payload = [("stopped", str(stopped), signal.Signals(installed_watch().received).name)]
        if self.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        if payload[0][0] == "stopped":
            self._stop_waiting(step, *payload[0][1:])
        _, results, metrics = payload[0]
        if not self.max_staleness:
            metrics.pop("async/trainer_wait_s")  # the generation itself, not a wait: timing_s/gen says it
        self._metrics = metrics
        return results

    def _mine(self, prompts, results, sampling: SamplingParams) -> list[Sample]:
        wanted = {p.global_index for p in prompts}
        return self._to_samples(prompts, [r for r in results if r.prompt_index in wanted], sampling)

    def _stop_waiting(self, step: int, why: str, signame: str):
        """A SIGTERM or SIGUSR1 while the step waited for servers: the run stops now, not at the step's
        end, which may never come (and would outlast Slurm's grace period): exit 75 without a new
        checkpoint, since nothing of the step was trained. The same command resumes from the last
        checkpoint, and the servers, told nothing, join the resumed trainer (as after a trainer's
        crash)."""
        watch = installed_watch()
        if watch is not None:
            watch.keep_until_exit = True  # a late signal must not cut the exit short
        if self.engine.endpoint is not None:
            self.engine.endpoint.log(f"megarl: {signame} while {why}: stopped without training step {step} and "
                                     f"without a new checkpoint; exit code {PREEMPTED_EXIT_CODE}, the same command "
                                     f"resumes from the last checkpoint (trainer.resume=auto)")
            self.engine.endpoint.close(farewell=False)
        raise Preempted(step - 1, signame)

    def release_memory(self) -> None:
        pass

    def delta_copy_bytes(self) -> int:
        return self._hand_over.hybrid.delta_copy_bytes()

    def data_state(self, current: dict) -> dict:
        """The data's position a checkpoint records: before the prompts of the first step in flight."""
        return self.data_states[min(self.in_flight)] if self.in_flight else current

    def close(self) -> None:
        if self.engine.endpoint is not None:
            self.engine.endpoint.close()


def open_fleet(cfg, model_dir: str, dtype: torch.dtype, rank: int, max_model_len: int | None = None,
               log=print) -> FleetEngine:
    """rollout.fleet's endpoint on rank 0 (bound to rollout.fleet.host only) and the engine over it;
    max_model_len: prompt + response tokens, told to the servers (vLLM sizes its sequences by it)."""
    f = cfg.rollout.fleet
    if rank != 0:
        return FleetEngine(None, f.min_servers)
    token = run_token(f.token_file, cfg.trainer.run_dir, log)
    with open(Path(model_dir) / "config.json") as file:
        model_config = json.load(file)
    endpoint = FleetEndpoint(f.host, f.port, token, f.heartbeat_s, model_config, DTYPE_NAMES[dtype], log=log,
                             engine=cfg.rollout.engine, tp=cfg.rollout.tp, max_model_len=max_model_len,
                             partial_rollout=cfg.async_.partial_rollout)
    launcher = "python" if cfg.rollout.tp == 1 else f"torchrun --nproc_per_node {cfg.rollout.tp}"
    log(f"megarl fleet: endpoint open on {endpoint.address}; start servers with `{launcher} -m megarl.rollout.serve "
        f"--trainer {endpoint.address} --token-file <a copy of rollout.fleet.token_file> --engine {cfg.rollout.engine}`")
    return FleetEngine(endpoint, f.min_servers)
