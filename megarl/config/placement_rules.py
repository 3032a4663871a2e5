"""rollout.placement's config rules: the values of rollout.placement / num_ranks and async.* that cannot
work (`check_placement`, run by the config check), and the ranks that train (`training_world`). The
world split itself is megarl.async_rollout.placement's."""
from __future__ import annotations

from megarl.config.schema import Config, ConfigError


def check_placement(cfg: Config) -> None:
    """Values of rollout.placement / num_ranks and async.* that cannot work (world size aside)."""
    r, a = cfg.rollout, cfg.async_
    if r.placement == "colocated":
        if r.num_ranks:
            raise ConfigError(f"rollout.num_ranks = {r.num_ranks} applies to rollout.placement=separate only; set "
                              f"rollout.placement=separate or rollout.num_ranks=0")
        if a.max_staleness or a.partial_rollout:
            raise ConfigError("async.max_staleness > 0 and async.partial_rollout need rollout ranks that keep generating while "
                              "the others train: set rollout.placement=separate and rollout.num_ranks (or async.max_staleness=0)")
        return
    alg = cfg.algorithm
    if alg.filter_groups.enable and a.max_staleness:
        # dynamic sampling's rounds are generated on demand with the current weights; requests drawn
        # ahead would interleave with them in the data order (a resume would then train prompts twice)
        raise ConfigError("algorithm.filter_groups.enable generates its rounds with the current weights, not "
                          f"async.max_staleness = {a.max_staleness} steps ahead: set async.max_staleness=0 or "
                          "algorithm.filter_groups.enable=false")
    if a.partial_rollout and not a.max_staleness:
        raise ConfigError("async.partial_rollout continues requests under newer weights, which async.max_staleness=0 never "
                          "sends mid-generation: set async.max_staleness >= 1 or async.partial_rollout=false")
    if r.placement == "fleet":
        _check_fleet(cfg)
        return
    if r.num_ranks < 1:
        raise ConfigError("rollout.placement=separate needs rollout.num_ranks >= 1 (the last ranks of the world generate)")
    if r.engine not in ("hf", "vllm"):
        raise ConfigError(f"rollout.placement=separate runs rollout.engine=hf or vllm so far, got {r.engine}: use one of "
                          f"those or rollout.placement=colocated")
    if r.engine == "vllm" and a.partial_rollout and r.tp > 1:
        # vLLM aborts and resubmits the running requests at an update (megarl.rollout.vllm_partial) on the
        # leading rank; its TP followers replay whole generate calls and would leave vLLM's lockstep
        raise ConfigError(f"async.partial_rollout with rollout.engine=vllm runs rollout.tp=1 engines, got rollout.tp = {r.tp}: "
                          f"set rollout.tp=1 (rollout.num_ranks engines of one rank) or async.partial_rollout=false")
    if r.num_ranks % r.tp:
        raise ConfigError(f"rollout.num_ranks = {r.num_ranks} is not divisible by rollout.tp = {r.tp}")
    if cfg.actor.routing_replay:
        # the rollout server returns tokens and log-probs only: without its routes the actor would route
        # afresh, silently not replaying
        raise ConfigError("actor.routing_replay needs the rollout's expert routes, which rollout.placement=separate does not "
                          "return yet: set actor.routing_replay=false or rollout.placement=colocated")
    if alg.adv_estimator == "remax":
        raise ConfigError("rollout.placement=separate does not run adv_estimator=remax yet (its greedy baseline is a second "
                          "generation per step): use rollout.placement=colocated")


def _check_fleet(cfg: Config) -> None:
    """What rollout.placement=fleet runs so far (megarl.rollout_side.fleet): steps up to
    async.max_staleness ahead (partial rollouts on hf servers), servers running the hf engine (one process) or
    the vllm engine (rollout.tp processes), single-turn samples. rollout.engine and rollout.tp name
    the servers' engine and its size (each starts with the same `--engine`, under torchrun
    --nproc_per_node rollout.tp; the trainer refuses another) and the training job builds none."""
    r, a = cfg.rollout, cfg.async_
    if r.num_ranks:
        raise ConfigError(f"rollout.num_ranks = {r.num_ranks} applies to rollout.placement=separate only; fleet servers join "
                          f"with `python -m megarl.rollout.serve`: set rollout.num_ranks=0")
    if r.engine not in ("hf", "vllm"):
        raise ConfigError(f"rollout.placement=fleet runs servers with rollout.engine=hf or vllm so far, got {r.engine}: set "
                          f"one of those or rollout.placement=colocated")
    if r.tp != 1 and r.engine != "vllm":
        raise ConfigError(f"rollout.placement=fleet runs servers of rollout.tp > 1 with rollout.engine=vllm (torchrun "
                          f"--nproc_per_node {r.tp} -m megarl.rollout.serve), got rollout.engine={r.engine} with rollout.tp = "
                          f"{r.tp}: set rollout.tp=1 or rollout.engine=vllm")
    if a.partial_rollout and r.engine != "hf":
        # the hf engine loads between tokens (a hook); vLLM would abort and resubmit, which its servers do not yet
        raise ConfigError(f"async.partial_rollout over a fleet runs rollout.engine=hf servers, got {r.engine}: set "
                          f"async.partial_rollout=false (async.max_staleness runs) or rollout.engine=hf")
    if cfg.algorithm.adv_estimator == "remax" and a.max_staleness:
        # the greedy baseline comes from the weights trained now; the samples from K updates before
        raise ConfigError("algorithm.adv_estimator=remax takes its greedy baseline from the current weights, but under "
                          f"async.max_staleness = {a.max_staleness} its samples come from older ones: set "
                          "async.max_staleness=0 or another algorithm.adv_estimator")
    for on, key in ((cfg.actor.routing_replay, "actor.routing_replay"),
                    (cfg.rollout.multi_turn.environment is not None, "rollout.multi_turn.environment")):
        if on:
            raise ConfigError(f"rollout.placement=fleet does not run {key} yet: turn it off or use "
                              f"rollout.placement=colocated")
    host = r.fleet.host
    if not host or host != host.strip() or "/" in host:
        raise ConfigError(f"rollout.fleet.host = {r.fleet.host!r} is not an interface address or name: give one, e.g. "
                          f"127.0.0.1 or the node's address on the network the servers reach")


def training_world(cfg: Config, world_size: int) -> int:
    """The ranks that train: the whole world colocated or fleet, the world less rollout.num_ranks separate."""
    if cfg.rollout.placement != "separate":
        return world_size
    if cfg.rollout.num_ranks >= world_size:
        raise ConfigError(f"rollout.num_ranks = {cfg.rollout.num_ranks} leaves no training rank in a world of {world_size}: "
                          f"launch more processes (torchrun --nproc_per_node) or lower rollout.num_ranks")
    return world_size - cfg.rollout.num_ranks
