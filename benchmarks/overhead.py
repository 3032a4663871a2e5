"""megarl's actor update against a plain transformers + torch.optim.AdamW loop: the framework tax.

    torchrun --standalone --nproc_per_node 1 benchmarks/overhead.py --out benchmarks/results/overhead_cpu.json
    python benchmarks/overhead.py --ppo-steps --out benchmarks/results/ppo_step_scaling_cpu.json

One process, one model (a random Llama of the preset's size, written once by make_tiny_model),
the same token ids, the same PPO loss (megarl.algorithms.losses.policy_loss, token-mean), the same
AdamW hyper-parameters and gradient clipping. An "update" is what the trainer's actor phase does
with a batch: old log-probs (a forward without grad) and one train step (forward, backward,
clip, AdamW). megarl: MegatronEngine.forward_only + train_step. Baseline: AutoModelForCausalLM
(sdpa attention) with a hand-written loop. The two alternate in one run (which goes first flips
every round, so a change in machine load hits both), at two sequence lengths with the same token
count per update. Reported: median seconds per update, ratio_megarl_over_baseline (the larger of
the two lengths' ratios at the top level, every length in "by_seq_len"; on CPU beside it
ratio_cpu_time, the ratio of the process's CPU seconds, which the neighbours' load on a shared
machine barely moves since each side runs on one thread), and model FLOPs
utilisation: FLOPs of the update (8 x non-embedding params per token for forward + forward +
backward, plus causal attention) per second over the device's peak (--peak-tflops on GPU; on CPU
the best float32 matmul rate this process reached, measured every round of the same run;
on a CPU shared with other jobs that best rate can still be below the idle peak, so MFU there is
an upper bound and the ratio is the number to read).

--ppo-steps instead measures whole PPO steps of the CPU demo (configs/tiny_cpu.yaml through
benchmarks/_ppo_probe.py, launch/ppo.py with rank 0's CPU seconds per phase): 1 against 2 data-parallel processes at the same
global batch (data.prompts_per_step is global), and the step time at several response lengths
(rollout.max_new_tokens; the measured mean response length is reported beside it, since eos may
end responses early), to show whether time grows linearly with length.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from _common import PRESETS, device_name, finish, random_llama  # benchmarks/_common.py

CLIP = (0.2, 0.2, 3.0)  # PPO clip ratios low, high, dual-clip c (policy_loss defaults)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="small")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per update (sequences x length)")
    p.add_argument("--seq-lens", type=int, nargs=2, default=(512, 1024))
    p.add_argument("--rounds", type=int, default=3, help="timed updates per side and length, after one warm-up")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="GPU peak of the dtype (H100/H200 bf16 dense: 989)")
    p.add_argument("--ppo-steps", action="store_true", help="measure PPO steps of the demo instead (see above)")
    p.add_argument("--steps", type=int, default=4, help="--ppo-steps: PPO steps per run (the first is dropped)")
    p.add_argument("--response-lengths", type=int, nargs="+", default=(4, 8, 16, 32), help="--ppo-steps: rollout.max_new_tokens values")
    p.add_argument("--overrides", nargs="*", default=[], help="--ppo-steps: config overrides for every run (key=value)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.ppo_steps:
        return ppo_steps(args)

    from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
    from megarl.distributed.parallel import dims_from_env

    gpu = torch.cuda.is_available()
    dims = dims_from_env().initialize()
    if dims.world_size != 1:
        raise SystemExit("overhead.py compares one process against one process: run it with --nproc_per_node 1")
    model_dir = random_llama(args.preset, dims, max_positions=max(args.seq_lens), tag="overhead")
    dtype = torch.bfloat16 if gpu else torch.float32
    optim = OptimConfig(lr=1e-6)
    engine = MegatronEngine(str(model_dir), dims, EngineConfig(dtype="bfloat16" if gpu else "float32", optim=optim,
                                                               max_tokens_per_microbatch=args.tokens))
    baseline = Baseline(model_dir, dtype, optim, engine.device)
    hidden, _, layers, _, _, vocab = PRESETS[args.preset]
    dense = baseline.params - vocab * hidden * (1 if baseline.tied else 2)  # no embedding lookup / with lm head once
    dense += vocab * hidden  # the output projection is a matmul
    peak = args.peak_tflops * 1e12 if gpu else cpu_matmul_flops()

    mfu = {}
    by_len = {}
    for seq in args.seq_lens:
        batch = make_batch(args.tokens // seq, seq, vocab)
        times = {"megarl": [], "baseline": []}
        cpu = {"megarl": [], "baseline": []}  # process CPU seconds: what the neighbours' load leaves alone
        runs = {"megarl": lambda: megarl_update(engine, batch), "baseline": lambda: baseline.update(batch)}
        for side in runs:  # warm-up
            runs[side]()
        loads = []  # the machine's 1-minute load average at each round (neighbours share the cores)
        for r in range(args.rounds):
            loads.append(round(os.getloadavg()[0], 2))
            for side in (("megarl", "baseline") if r % 2 == 0 else ("baseline", "megarl")):
                start_cpu = time.process_time()
                times[side].append(timed(runs[side], gpu))
                cpu[side].append(time.process_time() - start_cpu)
            if not gpu:  # a loaded CPU's matmul rate swings: keep the best seen during the run
                peak = max(peak, cpu_matmul_flops())
        tokens = args.tokens
        # forward (old log-probs) + forward + backward = 8 flops per param per token; causal attention
        # 4 * s * h per token per layer forward (QK^T and PV, halved by causality), x3 with backward.
        flops = 8 * dense * tokens + (4 + 12) * layers * seq * hidden * tokens // 2
        med = {side: statistics.median(t) for side, t in times.items()}
        mfu[str(seq)] = (flops, med)
        by_len[str(seq)] = {
            "sequences": args.tokens // seq, "seconds_megarl": [round(t, 4) for t in times["megarl"]],
            "seconds_baseline": [round(t, 4) for t in times["baseline"]],
            "ratio_megarl_over_baseline": round(med["megarl"] / med["baseline"], 3),
            # Each round's two runs are neighbours in time: their ratio is less exposed to load swings.
            "ratio_per_round_median": round(statistics.median(m / b for m, b in zip(times["megarl"], times["baseline"])), 3),
            "cpu_seconds_megarl": [round(t, 4) for t in cpu["megarl"]], "cpu_seconds_baseline": [round(t, 4) for t in cpu["baseline"]],
            # One thread per process on CPU: CPU time is the work, unlike wall time on a shared machine.
            "ratio_cpu_time": None if gpu else round(statistics.median(cpu["megarl"]) / statistics.median(cpu["baseline"]), 3),
            "ratio_cpu_time_per_round_median": None if gpu else round(statistics.median(
                m / b for m, b in zip(cpu["megarl"], cpu["baseline"])), 3),
            "load_average_1min_per_round": loads,
        }
    for seq, (flops, med) in mfu.items():  # against the final (best) peak
        by_len[seq].update(mfu_megarl=round(flops / med["megarl"] / peak, 4), mfu_baseline=round(flops / med["baseline"] / peak, 4))
    worst = max(by_len.values(), key=lambda r: r["ratio_megarl_over_baseline"])
    result = {
        "ratio_megarl_over_baseline": worst["ratio_megarl_over_baseline"],
        "mfu_megarl": worst["mfu_megarl"], "mfu_baseline": worst["mfu_baseline"],
        "by_seq_len": by_len,
        "preset": args.preset, "tokens_per_update": args.tokens, "dtype": str(dtype).removeprefix("torch."),
        "peak_flops": peak, "peak_source": "--peak-tflops" if gpu else "best measured float32 matmul rate of this process during the run",
        "command": "torchrun --standalone --nproc_per_node 1 benchmarks/overhead.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in vars(args).items()
            if k in ("preset", "tokens", "seq_lens", "rounds", "out") or (gpu and k == "peak_tflops")),
        "machine": {"device": device_name(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "python": platform.python_version()},
        "load_average_1_5_15": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    return finish(result, args.out, dims)


def ppo_steps(args) -> int:
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]

    def run(nproc: int, *overrides: str) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   "benchmarks/_ppo_probe.py", "--config", "configs/tiny_cpu.yaml", f"trainer.run_dir={run_dir}",
                   f"trainer.total_steps={args.steps}", "trainer.save_every_steps=0", "tracking.progress_bar=false",
                   "tracking.mlflow=false", *args.overrides, *overrides]
            subprocess.run(cmd, cwd=repo, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                           stdout=subprocess.DEVNULL)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "event" not in r][1:]  # the first step warms up
        med = lambda key: round(statistics.median(r[key] for r in rows), 4)  # noqa: E731
        for r in rows:  # rank 0's CPU seconds over the step's phases (_ppo_probe.py)
            r["bench/cpu_s/all_phases"] = sum(v for k, v in r.items() if k.startswith("bench/cpu_s/"))
        return {"step_seconds": med("timing_s/step"), "update_actor_seconds": med("timing_s/update_actor"),
                "gen_seconds": med("timing_s/gen"), "response_length_mean": med("response_length/mean"),
                # Responses that ran to max_new_tokens: padded micro-batches are as wide as they.
                "response_length_clip_ratio": med("response_length/clip_ratio"),
                "cpu_seconds_rank0": {"step": med("bench/cpu_s/all_phases"), "update_actor": med("bench/cpu_s/update_actor"),
                                      "gen": med("bench/cpu_s/gen")}}

    one, two = run(1), run(2)
    lengths = {str(n): run(2, f"rollout.max_new_tokens={n}") for n in args.response_lengths}
    result = {
        "dp_scaling": {"dp1": one, "dp2": two, "speedup_dp2_over_dp1": round(one["step_seconds"] / two["step_seconds"], 3),
                       # Work per rank, which the neighbours' load on a shared machine does not move.
                       "cpu_speedup_dp2_over_dp1": round(one["cpu_seconds_rank0"]["step"] / two["cpu_seconds_rank0"]["step"], 3)},
        "step_time_by_max_new_tokens_dp2": lengths,
        "command": f"python benchmarks/overhead.py --ppo-steps --steps {args.steps} --response-lengths "
                   + " ".join(map(str, args.response_lengths))
                   + (" --overrides " + " ".join(args.overrides) if args.overrides else "") + f" --out {args.out}",
        "machine": {"processor": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average_1_5_15": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "note": "medians over the steps after the first; the same global batch (data.prompts_per_step x "
                "rollout.samples_per_prompt of configs/tiny_cpu.yaml) in every run; cpu_seconds_rank0: process CPU "
                "seconds of rank 0 (benchmarks/_ppo_probe.py), the work a rank does whatever the machine's load",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


def make_batch(n: int, seq: int, vocab: int):
    from megarl.engine.batch import SequenceBatch

    g = torch.Generator().manual_seed(seq)
    resp = seq // 2
    ids = torch.randint(0, vocab, (n, seq), generator=g).tolist()
    return SequenceBatch(ids, [seq - resp] * n, list(range(n)), resp,
                         {"response_mask": torch.ones(n, resp), "advantages": torch.randn(n, resp, generator=g)})


def megarl_update(engine, batch) -> None:
    from megarl.algorithms.losses import policy_loss

    batch.tensors["old_logprobs"] = engine.forward_only(batch).logprobs

    def loss_fn(out, mb, totals):
        return policy_loss(out.logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mb.response_mask, *CLIP,
                           global_tokens=totals.tokens)

    engine.train_step(batch, loss_fn, fields=("old_logprobs", "advantages"), num_global=len(batch))


class Baseline:
    """The plain loop: transformers model, torch.optim.AdamW, the same loss and clipping."""

    def __init__(self, model_dir, dtype, optim, device):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
        self.tied = bool(self.model.config.tie_word_embeddings)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                           weight_decay=optim.weight_decay)
        self.max_grad_norm = optim.max_grad_norm
        self.device = device

    def logprobs(self, ids, prompt: int) -> torch.Tensor:
        logits = self.model(ids).logits[:, prompt - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, prompt:, None])[..., 0]

    def update(self, batch) -> None:
        from megarl.algorithms.losses import policy_loss

        ids = torch.tensor(batch.input_ids, device=self.device)
        prompt = batch.prompt_lens[0]
        mask, adv = (batch.tensors[k].to(self.device) for k in ("response_mask", "advantages"))
        self.model.train()
        with torch.no_grad():
            old = self.logprobs(ids, prompt)
        loss, _ = policy_loss(self.logprobs(ids, prompt), old, adv, mask, *CLIP, global_tokens=mask.sum())
        loss.backward()
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def timed(fn, gpu: bool) -> float:
    if gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def cpu_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """The best float32 matmul rate of this process (its threads), as the CPU's practical peak."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(timed(lambda: a @ b, False) for _ in range(repeats))
    return 2 * n ** 3 / best


if __name__ == "__main__":
    raise SystemExit(main())
