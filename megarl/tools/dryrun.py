"""A run at its real world size on one CPU: every chosen rank's process groups and engines, built.

    python -m megarl.tools.dryrun --config configs/deepseek-v3-671b.yaml --world-size 256 \
        model.path=configs/models/deepseek-v3 --ranks all --json runs/dryrun-671b.json
    python launch/ppo.py --config configs/deepseek-v3-671b.yaml --dry-run --world-size 256

For each chosen rank (`--ranks all`, or a list such as 0,17,255) the tool becomes that rank of a
world of `--world-size` on torch's fake communication backend (collectives do nothing), builds
Megatron's process groups and the trainer's own engines (actor, critic, reference) on the meta
device from the model's config.json alone (a hub id fetches only config.json), with Megatron's DDP
buffers and distributed optimizer, and counts what the rank holds: parameters, gradients and
optimizer state by dtype, beside the planner's figures for the same rank (megarl.capacity).
Ranks with the same model-parallel coordinates (pp, tp, cp, ep, etp) build the same shards: one
build stands for them all (the report lists them; their optimizer shards differ in position only).

It also makes the weight-sync plan into the rollout layout with the 3D-HybridEngine's own planner
(megarl.tools.dryrun_sync; needs one built rank per pipeline stage) and lists the pieces each rank
writes in a checkpoint save (megarl.tools.dryrun_checkpoint).

It checks, and fails with one line naming the rank (exit 1): Megatron's groups agree with megarl's
rank map; every layer on exactly one pipeline stage (virtual stages included); every expert on
exactly one expert-parallel rank of its stage; with every rank built, the unique parameters over
all ranks sum to the count from config.json; the weight-sync plan covers every rollout shard
exactly once; no checkpoint piece is written by two ranks (with every rank built: each tensor's
pieces fill it). A config or layout that cannot work is refused before anything is built, with the
trainer's own checks (one line, exit 2). Exit 0 otherwise.
`--json` writes the report: world_size, total_unique_parameters, parameters_from_config,
weight_sync, checkpoint and ranks (rank, stands_for, coordinates, param_bytes, grad_bytes,
optimizer_bytes, planner, roles, sync_recv_bytes, sync_send_bytes, sync_bound_bytes,
sync_needed_bytes, planner_sync_recv_bytes_max, checkpoint_bytes, checkpoint_gather_bytes,
checkpoint_shards).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megarl import hub
from megarl.config import load_config, validate
from megarl.config.inputs import check_model_layout
from megarl.config.placement_rules import training_world
from megarl.config.validation import layout_of
from megarl.tools.dryrun_errors import InvariantError


def parser(prog: str = "python -m megarl.tools.dryrun") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the run's YAML config (configs/*.yaml)")
    p.add_argument("--world-size", type=int, required=True, help="processes of the real run (each shipped config names its own)")
    p.add_argument("--ranks", default="all", help="'all' or a comma-separated list of ranks, e.g. 0,17,255 (default: all)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for launch/ppo.py (e.g. model.path=DIR)")
    return p


def parse_with_dry_run(p: argparse.ArgumentParser, argv):
    """launch/ppo.py's arguments with its dry-run flags: --dry-run --world-size N [--ranks ...] [--json PATH]."""
    dry = p.add_argument_group("dry run (docs/operations.md, 'Before the cluster: the dry run')")
    dry.add_argument("--dry-run", action="store_true", help="build every rank of the run on this CPU, without data or "
                     "weights, check it and compare it with the planner; nothing is trained")
    dry.add_argument("--world-size", type=int, help="with --dry-run: the processes of the real run")
    dry.add_argument("--ranks", default="all", help="with --dry-run: 'all' or ranks such as 0,17,255")
    dry.add_argument("--json", help="with --dry-run: write the report here")
    args = p.parse_args(argv)
    if args.dry_run and args.world_size is None:
        p.error("--dry-run needs --world-size N (the processes of the real run; each shipped config names its own)")
    if not args.dry_run and (args.world_size is not None or args.json):
        p.error("--world-size and --json belong to --dry-run (a real run's world size is torchrun's)")
    return args


def parse_ranks(text: str, world_size: int) -> list[int]:
    """`all` or a comma-separated list of ranks of the world (ValueError naming the bad one)."""
    if text.strip() == "all":
        return list(range(world_size))
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise ValueError(f"--ranks {text!r}: give 'all' or comma-separated ranks such as 0,17,255") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise ValueError(f"--ranks {text!r}: ranks must lie in 0..{world_size - 1} (--world-size {world_size})")
    return ranks


def checked_config(config: str, overrides: list[str], world_size: int):
    """(cfg, model_dir, training world) after the trainer's own checks; ValueError: one line."""
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    cfg = load_config(config, overrides)
    validate(cfg, world_size)  # values and layout arithmetic (ConfigError is a ValueError)
    model_dir = hub.local_path(cfg.model.path, "model.path", hub.CONFIG_ONLY)
    check_model_layout(cfg, {"model.path": model_dir})  # the model against the layout, before any model is built
    return cfg, model_dir, training_world(cfg, world_size)


def build_classes(layout, ranks: list[int]) -> dict[int, list[int]]:
    """{representative rank: the chosen ranks it stands for}: ranks with the same (pp, tp, cp, ep, etp)."""
    classes: dict[tuple, list[int]] = {}
    for r in ranks:
        c = layout.coords(r)
        classes.setdefault((c.pp, c.tp, c.cp, c.ep, c.etp), []).append(r)
    return {members[0]: members for members in classes.values()}


def main(argv=None, prog: str = "python -m megarl.tools.dryrun") -> int:
    args = parser(prog).parse_args(argv)
    return run(args.config, args.world_size, args.overrides, args.ranks, args.json)


def run(config: str, world_size: int, overrides: list[str], ranks_text: str = "all", json_path: str | None = None) -> int:
    # deferred: torch (megarl.platform imports it); launch/ppo.py imports this module to parse its arguments
    from megarl.platform import init_platform, quiet_known_warnings

    quiet_known_warnings()
    try:
        cfg, model_dir, world = checked_config(config, list(overrides), world_size)

        layout = layout_of(cfg.parallel, world)
        ranks = parse_ranks(ranks_text, world)
    except Exception as err:  # ConfigError, HubError, UnsupportedModelError: all one line for the user
        if not isinstance(err, ValueError) and type(err).__name__ != "HubError":
            raise
        print(f"config error: {err}", file=sys.stderr)
        return 2
    # deferred: torch and Megatron (every rank's build), loaded after the config check
    import torch.distributed as dist

    from megarl.platform import fake_world
    from megarl.tools import dryrun_checks
    from megarl.tools.dryrun_rank import build_rank

    if dist.is_initialized() and not fake_world.is_fake():
        print("error: the dry run becomes each rank of a fake world in turn and needs a process of its own: run it "
              "with python, not under torchrun", file=sys.stderr)
        return 2
    init_platform(force_cpu=True)  # the fake world lives on the CPU whatever this machine has

    start = time.perf_counter()
    classes = build_classes(layout, ranks)
    builds = []
    try:
        for i, (rep, members) in enumerate(classes.items()):
            build = build_rank(cfg, model_dir, world, rep)
            dryrun_checks.check_rank(build, layout, model_dir)
            builds.append((build, members))
            print(f"built rank {rep} ({i + 1}/{len(classes)}, stands for {len(members)}) in {build.seconds:.1f} s", flush=True)
        report = dryrun_checks.report(cfg, model_dir, layout, builds, complete=len(ranks) == world)
    except InvariantError as err:
        print(f"dry run failed: {err}", file=sys.stderr)
        return 1
    finally:
        fake_world.leave()
    report["wall_seconds"] = round(time.perf_counter() - start, 1)
    print(dryrun_checks.render(report))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
