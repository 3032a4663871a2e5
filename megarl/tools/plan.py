"""Size an RL run on paper: does a layout fit, what does a weight sync cost, where does the time go.

    python -m megarl.tools.plan --model DeepSeek-V3/config.json --gpus 256 --gpus-per-node 8 \
        --gpu h100-80gb --tp 1 --pp 16 --ep 16 --first-stage-layers 3 --last-stage-layers 2 \
        --rollout-tp 32 --recompute full --param-offload --grad-offload --optimizer-offload \
        --prompts-per-step 32 --samples-per-prompt 16 --prompt-len 512 --response-len 1024 --json plan.json
    python -m megarl.tools.plan --model Qwen2.5-7B --gpus 8 --gpus-per-node 8 --gpu h100-80gb --search
    python -m megarl.tools.plan --model Qwen/Qwen2.5-7B-Instruct --gpus 8 --search   # a hub id: config.json only

Prints per-GPU memory by phase (training: parameters, gradients, distributed-optimizer state,
activations; rollout: the weights in the rollout layout and the KV cache; what offload moves),
the weight-sync bytes per GPU (HybridFlow's bound, megarl's plan, the naive all-gather) and their
time at the link bandwidth, and a step-time estimate by phase at an assumed MFU. `--json PATH`
writes the report; its top-level `fits` is true or false and `params_total` the parameter count.
The arithmetic, with its assumptions, is in megarl/capacity/. Exit status: 0 fits, 1 does not fit,
2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megarl import hub
from megarl.capacity import Cluster, Layout, RunShape, arch_from_config, gpu_table, load_config, plan, search
from megarl.capacity.estimate import DELTA_CHANGED_FRACTION
from megarl.capacity.placement import best_split, placement_times


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megarl.tools.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face config.json, the directory holding one, or a hub id (org/name[@revision]: "
                                                "only its config.json is fetched)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, required=True, help="GPUs in the run")
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--gpu", default="h100-80gb", help="a GPU kind of the table (see --list-gpus)")
    c.add_argument("--gpu-table", help="JSON file adding GPU kinds: {name: {memory_gib, bf16_tflops, nvlink_gb_s, ib_gb_s}}")
    c.add_argument("--list-gpus", action="store_true", help="print the GPU table and exit")
    lay = p.add_argument_group("training layout")
    lay.add_argument("--tp", type=int, default=1)
    lay.add_argument("--pp", type=int, default=1)
    lay.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per GPU (interleaved 1F1B)")
    lay.add_argument("--first-stage-layers", type=int, help="layers on the first pipeline stage (uneven split)")
    lay.add_argument("--last-stage-layers", type=int, help="layers on the last pipeline stage (uneven split)")
    lay.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE)")
    lay.add_argument("--etp", type=int, help="expert tensor parallelism (default: --tp)")
    lay.add_argument("--cp", type=int, default=1, help="context parallelism")
    lay.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                     help="plan tp > 1 without sequence parallelism (parallel.sequence_parallel=false; refused for MoE training)")
    lay.add_argument("--dp", type=int, help="data parallelism; derived from the others, given only to check it")
    lay.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    lay.add_argument("--param-offload", action="store_true", help="parameters leave the GPU while the rollout generates")
    lay.add_argument("--grad-offload", action="store_true", help="gradients leave the GPU while the rollout generates")
    lay.add_argument("--optimizer-offload", nargs="?", const="phases", default="none", choices=("none", "phases", "cpu"),
                     help="optimizer state off the GPU: 'phases' (megarl: during the rollout) or 'cpu' (Megatron's CPU "
                          "optimizer: always; not in megarl yet)")
    run = p.add_argument_group("run shape")
    run.add_argument("--rollout-tp", type=int, default=1, help="tensor parallelism of the rollout engine")
    run.add_argument("--gpu-memory-fraction", type=float, default=0.6, help="the rollout engine's share of GPU memory")
    run.add_argument("--prompts-per-step", type=int, default=256)
    run.add_argument("--samples-per-prompt", type=int, default=8)
    run.add_argument("--prompt-len", type=int, default=1024, help="tokens")
    run.add_argument("--response-len", type=int, default=4096, help="tokens")
    run.add_argument("--micro-batch-tokens", type=int, default=8192, help="tokens per micro-batch per DP rank")
    run.add_argument("--ppo-epochs", type=int, default=1)
    run.add_argument("--critic", action="store_true", help="GAE: a critic engine beside the actor")
    run.add_argument("--no-ref", dest="ref", action="store_false", help="no KL reference engine")
    run.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank train (actor.lora.rank); the base is "
                     "frozen and the reference is the actor with its adapters off")
    run.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="training weights")
    run.add_argument("--mfu", type=float, default=0.35, help="assumed MFU of training forward/backward")
    run.add_argument("--gen-mfu", type=float, default=0.10, help="assumed MFU of generation (memory-bound)")
    run.add_argument("--overhead-gb", type=float, default=4.0, help="GiB per GPU for CUDA context, NCCL, fragmentation")
    run.add_argument("--weight-sync", choices=("full", "delta"), default="full",
                     help="rollout.weight_sync.mode: delta sends only the changed bf16 elements and keeps a copy of what crossed")
    run.add_argument("--delta-changed-fraction", type=float, default=DELTA_CHANGED_FRACTION,
                     help="with --weight-sync delta: the share of bf16 elements that change per sync (default: "
                          "benchmarks/delta_sync.py at lr 1e-6)")
    pl = p.add_argument_group("rollout placement (docs/async_rl.md)")
    pl.add_argument("--rollout-gpus", type=int, help="GPUs that only generate under rollout.placement=separate "
                                                     "(default: the split with the shortest asynchronous step)")
    pl.add_argument("--max-staleness", type=int, default=1, help="async.max_staleness K of the separate-async estimate")
    p.add_argument("--search", action="store_true", help="also rank the layouts that fit")
    p.add_argument("--json", help="write the report here")
    return p


def _positive(args) -> None:
    for name in ("gpus", "gpus_per_node", "tp", "pp", "vpp", "ep", "cp", "rollout_tp", "prompts_per_step", "samples_per_prompt",
                 "prompt_len", "response_len", "micro_batch_tokens", "ppo_epochs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank must be at least 0, got {args.lora_rank}")
    if args.etp is not None and args.etp < 1:
        raise ValueError(f"--etp must be at least 1, got {args.etp}")
    if not 0 < args.gpu_memory_fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction}")
    if not 0 <= args.delta_changed_fraction <= 1:
        raise ValueError(f"--delta-changed-fraction must be in [0, 1], got {args.delta_changed_fraction}")
    if not (0 < args.mfu <= 1 and 0 < args.gen_mfu <= 1):
        raise ValueError("--mfu and --gen-mfu must be in (0, 1]")


def build(args) -> tuple:
    _positive(args)
    table = gpu_table(args.gpu_table)
    if args.gpu not in table:
        raise ValueError(f"--gpu {args.gpu!r} is not in the GPU table ({', '.join(table)}); add it with --gpu-table FILE.json")
    arch = arch_from_config(load_config(hub.local_path(args.model, "--model", hub.CONFIG_ONLY)))
    lay = Layout(tp=args.tp, pp=args.pp, vpp=args.vpp, first_stage_layers=args.first_stage_layers,
                 last_stage_layers=args.last_stage_layers, ep=args.ep, etp=args.etp, cp=args.cp, rollout_tp=args.rollout_tp,
                 sequence_parallel=args.sequence_parallel)
    shape = RunShape(prompts_per_step=args.prompts_per_step, samples_per_prompt=args.samples_per_prompt, prompt_len=args.prompt_len,
                     response_len=args.response_len, max_tokens_per_microbatch=args.micro_batch_tokens, ppo_epochs=args.ppo_epochs,
                     critic=args.critic, ref=args.ref, recompute=args.recompute, param_offload=args.param_offload,
                     grad_offload=args.grad_offload, optimizer_offload=args.optimizer_offload, dtype=args.dtype,
                     gpu_memory_fraction=args.gpu_memory_fraction, mfu=args.mfu, gen_mfu=args.gen_mfu, overhead_gib=args.overhead_gb,
                     lora_rank=args.lora_rank, weight_sync=args.weight_sync, delta_changed_fraction=args.delta_changed_fraction)
    cluster = Cluster(args.gpus, args.gpus_per_node, table[args.gpu])
    if args.gpus_per_node > args.gpus and args.gpus > 1:
        cluster = Cluster(args.gpus, args.gpus, table[args.gpu])
    mp = args.tp * args.pp * args.cp
    if args.dp is not None and args.dp * mp != args.gpus:
        raise ValueError(f"--dp {args.dp} x tp {args.tp} x pp {args.pp} x cp {args.cp} = {args.dp * mp} != --gpus {args.gpus}")
    return arch, lay, shape, cluster


def render(report: dict) -> str:
    m, s, t = report["memory_gib"], report["sync"], report["step_time_s"]
    tr, ro = m["training"], m["rollout"]
    lay = report["layout"]
    lines = [
        f"model: {report['model']['model_type']}, {report['params_total'] / 1e9:.2f}B parameters "
        f"({report['params_active'] / 1e9:.2f}B active per token"
        + (f"; MTP {report['params_mtp_not_trained'] / 1e9:.2f}B not trained" if report["params_mtp_not_trained"] else "") + ")",
        f"cluster: {report['cluster']['gpus']} x {report['cluster']['name']} ({report['cluster']['memory_gib']:g} GiB)",
        "layout: " + " ".join(f"{k}={v}" for k, v in lay.items() if v is not None),
        f"training, per GPU (stage {tr['stage']}): params {tr['params']:.2f} + grads {tr['grads']:.2f} + optimizer "
        f"{tr['optimizer']:.2f} + activations {tr['activations']:.2f} + logits {tr['logits']:.2f} + weight-sync copy "
        f"{tr['weight_sync_copy']:.2f} + overhead "
        f"{tr['overhead']:.2f} = {tr['total']:.2f} GiB -> {'fits' if tr['fits'] else 'DOES NOT FIT'}",
        f"rollout, per GPU: training state left {ro['training_state']:.2f} + weight-sync copy {ro['weight_sync_copy']:.2f} + rollout budget {ro['rollout_budget']:.2f} (weights "
        f"{ro['rollout_weights']:.2f}, KV cache {ro['kv_cache']:.2f} = {ro['kv_cache_tokens']} tokens, "
        f"{ro['generation_waves']} wave(s)) + overhead {ro['overhead']:.2f} = {ro['total']:.2f} GiB -> "
        f"{'fits' if ro['fits'] else 'DOES NOT FIT'}",
        f"offload: {m['offload']['to_host_and_back_per_step']:.2f} GiB per GPU to host and back each step",
        f"weight sync per GPU: megarl {s['megarl_bytes_per_gpu'] / 2**30:.3f} GiB (HybridFlow bound "
        + (f"{s['hybridflow_bytes_per_gpu'] / 2**30:.3f}" if s["hybridflow_bytes_per_gpu"] is not None else "n/a: rollout tp > tp x pp")
        + (f", naive all-gather {s['naive_bytes_per_gpu'] / 2**30:.3f}" if s["naive_bytes_per_gpu"] is not None else "")
        + f") -> {s['seconds']:.2f} s over {s['link']}"
        + (f"; delta sync at {100 * s['delta_changed_fraction']:.1f}% changed: {s['bytes_per_sync_per_gpu'] / 2**30:.3f} GiB per sync, "
           f"copy kept {s['weight_sync_copy_bytes_per_gpu'] / 2**30:.3f} GiB per GPU" if s["weight_sync"] == "delta" else ""),
        "step time (s): " + ", ".join(f"{k} {v:.2f}" for k, v in t.items() if k not in ("total", "sync_share", "assumed_mfu", "assumed_gen_mfu", "pipeline_bubble"))
        + f"; total {t['total']:.2f} (sync {100 * t['sync_share']:.1f}%) at assumed MFU {t['assumed_mfu']:g}, generation "
        f"{t['assumed_gen_mfu']:g}, pipeline bubble {100 * t['pipeline_bubble']:.1f}%",
    ]
    if report.get("placement"):
        pl = report["placement"]
        lines.append(f"placement: colocated {pl['colocated_sync_s']:.2f} s/step; separate ({pl['rollout_gpus']} rollout + "
                     f"{pl['train_gpus']} training GPUs) {pl['separate_sync_s']:.2f} s synchronous, {pl['separate_async_s']:.2f} s "
                     f"with async.max_staleness={pl['max_staleness']} ({pl['separate_async_over_separate_sync']:.2f}x separate-sync, "
                     f"{pl['separate_async_over_colocated_sync']:.2f}x colocated); idle async: rollout "
                     f"{100 * pl['idle_fraction']['separate_async']['rollout']:.0f}%, training "
                     f"{100 * pl['idle_fraction']['separate_async']['train']:.0f}%")
    if "lora" in report:
        lo = report["lora"]
        lines.append(f"LoRA rank {lo['rank']}: {lo['adapter_params'] / 1e6:.1f}M adapter parameters train (grads "
                     f"{lo['adapter_grads_gib']:.3f} + optimizer {lo['adapter_optimizer_gib']:.3f} GiB per GPU), "
                     f"{lo['base_params_frozen'] / 1e9:.2f}B base parameters frozen (no grads, no optimizer state, no reference copy)")
    lines += [f"does not fit: {p}" for p in report["problems"]]
    if "search" in report:
        lines.append("layouts that fit, fastest first:" if report["search"] else "no layout of the search fits")
        for f in report["search"]:
            lines.append("  " + " ".join(f"{k}={v}" for k, v in f["layout"].items() if k not in ("vpp",)) +
                         f": step {f['step_time_s']:.1f} s, training {f['training_gib']:.1f} GiB, rollout {f['rollout_gib']:.1f} GiB")
    lines.append("FITS" if report["fits"] else "DOES NOT FIT")
    return "\n".join(lines)


def placement_estimate(report: dict, cluster, args) -> dict | None:
    """Colocated, separate-sync and separate-async step times from the report's phase costs
    (megarl.capacity.placement); None on one GPU (nothing to split)."""
    if cluster.gpus < 2:
        return None
    # the two groups are apart: across nodes unless the whole run fits in one
    link = cluster.gpu.nvlink_gb_s if cluster.gpus <= cluster.gpus_per_node else cluster.gpu.ib_gb_s
    phases, model_bytes = report["step_time_s"], report["sync"]["model_bytes"]
    common = dict(model_bytes=model_bytes, rollout_tp=args.rollout_tp, link_bytes_per_s=link * 1e9, max_staleness=args.max_staleness)
    if args.rollout_gpus is not None:
        return placement_times(phases, cluster.gpus, args.rollout_gpus, **common)
    return best_split(phases, cluster.gpus, **common)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.list_gpus:
            for g in gpu_table(args.gpu_table).values():
                print(f"{g.name}: {g.memory_gib:g} GiB, {g.bf16_tflops:g} TFLOP/s bf16, NVLink {g.nvlink_gb_s:g} GB/s, IB {g.ib_gb_s:g} GB/s")
            return 0
        arch, lay, shape, cluster = build(args)
        report = plan(arch, lay, shape, cluster)
        report["placement"] = placement_estimate(report, cluster, args)
        if args.search:
            report["search"] = search(arch, shape, cluster, base=lay)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(render(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
