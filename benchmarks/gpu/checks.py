"""The GPU checks of issues 13, 12 and 42, one process each, run by benchmarks/gpu/run_checks.sh.

    python benchmarks/gpu/checks.py matmul --out benchmarks/results/gpu [--tiny]
    python benchmarks/gpu/checks.py actor  --out benchmarks/results/gpu [--tiny]
    python benchmarks/gpu/checks.py parity --out benchmarks/results/gpu [--tiny] [--families llama ...]
    python benchmarks/gpu/checks.py delta  --out benchmarks/results/gpu [--tiny]

matmul: the device's measured dense peak, TFLOP/s of an 8192^3 bf16 matmul (--tiny: 256^3 float32
on CPU), the achievable ceiling the actor's MFU is also reported against. Writes matmul_peak.json.

actor (issue 13): megarl's actor update -- old log-probs (forward only) + one train step (forward,
backward, clip, Adam), exactly what benchmarks/overhead.py times -- of a ~1B dense Llama (preset
1b: 16 layers, hidden 2048, vocab 32000) in bf16, with megarl's own SDPA core attention (no
Transformer-Engine), and its MFU: model FLOPs of the update (megarl.capacity.forward_flops_per_token
x 4: the forward-only pass + forward + backward; matmul weights with the LM head, causal attention,
no embedding lookup) per second, over the datasheet peak (--peak-tflops, 989: H100/H200 bf16 dense;
`mfu_of_datasheet_peak`, what the 40% target is about) and over the matmul peak measured on the
device in the same process (`mfu_of_measured_matmul_peak`: an H200 reaches 769-798 of the 989).
Writes actor_update_1b.json.

parity (issue 12): for every family in megarl.models.families.FAMILIES, a tiny random model
(make_tiny_model) scored by megarl in bf16 against transformers: max and mean |d logprob| of
megarl-bf16 vs transformers-fp32, beside transformers-bf16 vs transformers-fp32 (what bf16 alone
costs), so a reader can tell a bf16 kernel's noise from a wrong model. The MoE families run the
MoE forward without Transformer-Engine. A family that raises is recorded with its error, and the
others still run. Writes parity_bf16.json after every family ("complete": false until the last), so
a time-out keeps the families already measured.

delta (issue 42): the device side of rollout.weight_sync.mode=delta on one GPU. benchmarks/delta_sync.py
measures bytes and time over a real link between two ranks (2 GPUs with NCCL, or gloo on CPU); with
one GPU there is no link, so this check measures what a delta costs on the device against what it
saves on the wire: the models and PPO updates of benchmarks/delta_sync.py (TinyLlama-1.1B's layer
shapes, a small-expert MoE; fp32 masters, AdamW) at lr 1e-6 and 1e-5, each weight's bf16 copy encoded
against the last one (megarl.hybrid.delta.encode, the sender's work) and applied to a receiver's copy
(delta.apply), checked bit for bit, timed against a plain device copy of the same bytes. Per lr:
`bytes_over_full`, the changed fraction, encode and apply GB/s of full bytes, and
`break_even_link_gbps`: the link bandwidth below which the delta is faster end to end (the bytes
it saves take longer on the wire than its encode + apply). Writes delta_sync_device.json.

Every check writes its JSON as soon as it has numbers (`save`), not only at the end.
Not here yet (a place is kept in run_checks.sh): the long-context check and the LoRA check, for
when megarl has long-context training and LoRA.

--tiny runs the same code on CPU in float32 at toy sizes (the "tiny" preset, a few tokens): that
is how the script is tested where there is no GPU (tests/benchmarks/test_gpu_checks_tiny.py).
Exit status: 0 when every check ran and passed, 1 when one failed (the JSON says which).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))  # _common, overhead

MFU_TARGET = 0.40  # issue 13: the ~1B actor update in bf16 without TE reaches at least 40% MFU (of the datasheet peak)
OUTPUTS = {"matmul": "matmul_peak.json", "actor": "actor_update_1b.json", "parity": "parity_bf16.json",
           "delta": "delta_sync_device.json"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("check", choices=tuple(OUTPUTS))
    p.add_argument("--out", required=True, help="folder for the JSON results")
    p.add_argument("--tiny", action="store_true", help="toy sizes in float32 (a CPU dry run of the same code)")
    p.add_argument("--seq-len", type=int, default=2048, help="actor: tokens per sequence")
    p.add_argument("--sequences", type=int, default=8, help="actor: sequences per update (one packed micro-batch)")
    p.add_argument("--iters", type=int, default=3, help="actor: timed updates after two warm-ups")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense peak in the dtype (H100/H200 bf16: 989)")
    p.add_argument("--families", nargs="+", help="parity: these families only (default: all of FAMILIES)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu and not args.tiny:
        print("error: no CUDA device; run with --tiny for a CPU dry run of the same code", file=sys.stderr)
        return 2
    from megarl.distributed.parallel import dims_from_env

    out = Path(args.out) / OUTPUTS[args.check]
    if args.tiny:
        out = out.with_name(out.stem + "_tiny.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment(gpu)

    def save(result: dict) -> None:
        """Write what is known so far (replaced atomically: a time-out leaves the last complete write)."""
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**result, "environment": env}, indent=1) + "\n")
        tmp.replace(out)

    if args.check == "matmul":
        result = matmul(args, gpu)
        save(result)
    elif args.check == "delta":
        result = delta_on_device(args, gpu, save)
    else:
        from megarl.distributed.parallel import dims_from_env

        dims = dims_from_env().initialize()
        result = (actor if args.check == "actor" else parity)(args, dims, gpu, save)
        torch.distributed.destroy_process_group()
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


def matmul_tflops(gpu: bool, tiny: bool, iters: int = 20) -> float:
    """Dense matmul TFLOP/s on this device: 8192^3 in bf16 on a GPU (256^3 float32 with --tiny)."""
    n, dtype, device = (256, torch.float32, "cpu") if tiny else (8192, torch.bfloat16, "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):  # warm-up: cuBLAS heuristics, clocks
        a @ b
    if gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    if gpu:
        torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def matmul(args, gpu: bool) -> dict:
    tflops = matmul_tflops(gpu, args.tiny)
    return {"check": "measured dense matmul peak (8192^3 bf16; --tiny: 256^3 float32 on CPU)",
            "size": 256 if args.tiny else 8192, "dtype": "float32" if args.tiny else "bfloat16",
            "measured_tflops": round(tflops, 3 if gpu else 6), "datasheet_peak_tflops": args.peak_tflops,
            "fraction_of_datasheet": round(tflops / args.peak_tflops, 4) if gpu else None, "ok": tflops > 0}


def actor(args, dims, gpu: bool, save) -> dict:
    from _common import PRESETS, random_llama
    from overhead import make_batch, megarl_update

    from megarl.engine.engine import EngineConfig, MegatronEngine, OptimConfig
    from megarl.capacity import arch_from_config, load_config
    from megarl.capacity.arch import forward_flops_per_token

    preset = "tiny" if args.tiny else "1b"
    seq, n = (64, 4) if args.tiny else (args.seq_len, args.sequences)
    vocab = PRESETS[preset][-1]
    model_dir = random_llama(preset, dims, max_positions=seq, tag="gpucheck")
    dtype = "bfloat16" if gpu else "float32"
    engine = MegatronEngine(str(model_dir), dims, EngineConfig(dtype=dtype, optim=OptimConfig(lr=1e-6),
                                                               max_tokens_per_microbatch=n * seq))
    core = type(engine.module.decoder.layers[0].self_attention.core_attention)
    batch = make_batch(n, seq, vocab)
    measured_peak = matmul_tflops(gpu, args.tiny)  # the same device, before the model's memory is fragmented
    save({"check": "issue 13: actor update (in progress: the model is built, updates not timed yet)",
          "measured_matmul_tflops": round(measured_peak, 3 if gpu else 6), "ok": False, "complete": False})
    for _ in range(2):  # warm-up: kernel selection, allocator
        megarl_update(engine, batch)
    seconds = []
    for _ in range(args.iters):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        megarl_update(engine, batch)
        if gpu:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    best = min(seconds)
    # forward_flops_per_token takes the mean attended length: seq / 2 under a causal mask.
    flops = 4 * forward_flops_per_token(arch_from_config(load_config(model_dir)), seq / 2) * n * seq
    tflops = flops / best / 1e12
    mfu = tflops / args.peak_tflops if gpu else None
    result = {
        "check": "issue 13: actor update (old log-probs + train step) of a dense Llama, no Transformer-Engine",
        "preset": preset, "params": sum(p.numel() for p in engine.module.parameters()), "dtype": dtype,
        "seq_len": seq, "sequences": n, "tokens_per_update": n * seq,
        "core_attention": f"{core.__module__}.{core.__qualname__}",
        "seconds_per_update": [round(s, 4) for s in seconds], "model_flops_per_update": flops,
        "model_tflops": round(tflops, 3 if gpu else 6),
        # Two denominators: the datasheet's dense peak (the 40% target) and what a plain 8192^3 matmul
        # reaches on this device (an H200 measured 769-798 TFLOP/s of the datasheet's 989).
        "datasheet_peak_tflops": args.peak_tflops, "mfu_of_datasheet_peak": None if mfu is None else round(mfu, 4),
        "measured_matmul_tflops": round(measured_peak, 3 if gpu else 6),
        "mfu_of_measured_matmul_peak": round(tflops / measured_peak, 4) if gpu else None,
        "mfu_target": MFU_TARGET, "mfu_target_of": "datasheet peak",
        "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
        # On CPU (--tiny) there is no peak to measure against: the run only shows the code works.
        "ok": all(s > 0 for s in seconds) and (mfu is None or mfu >= MFU_TARGET),
        "flops_note": "megarl.capacity.forward_flops_per_token(seq/2) x 4 per token: matmul weights incl. the LM head "
                      "(no embedding lookup) and causal attention; forward-only + forward + backward",
        "complete": True,
    }
    save(result)
    return result


def parity(args, dims, gpu: bool, save) -> dict:
    from megarl.models.families import FAMILIES

    families = args.families or list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"error: unknown families {unknown}; FAMILIES has {list(FAMILIES)}")
    gen = torch.Generator().manual_seed(0)
    lengths = (7, 12, 3, 9, 16) if args.tiny else (7, 12, 3, 9, 16, 64, 128, 200)
    rows, ok = {}, True

    def result(complete: bool) -> dict:
        return {"check": "issue 12: bf16 log-probs of megarl vs transformers, every family (MoE forward without TE)",
                "sequence_lengths": list(lengths), "families": rows, "ok": ok and complete, "complete": complete,
                "families_pending": [f for f in families if f not in rows],
                "rule": "ok when megarl-bf16 vs transformers-fp32 has mean |d| <= 2 x transformers-bf16's own mean |d| + 0.01 "
                        "and max |d| <= 2 x its max |d| + 0.05 (--tiny: float32, both within 1e-4)"}

    for family in families:
        model_dir = Path(tempfile.mkdtemp(prefix=f"megarl_gpucheck_{family}_"))
        try:
            rows[family] = parity_one(family, model_dir, dims, gpu, lengths, gen)
            ok &= rows[family]["ok"]
        except Exception as err:  # one broken family must not hide the others' numbers
            rows[family] = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            ok = False
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)
        save(result(complete=False))  # this family's numbers survive a time-out of the ones after it
    final = result(complete=True)
    save(final)
    return final


def parity_one(family: str, model_dir: Path, dims, gpu: bool, lengths, gen) -> dict:
    from transformers import AutoModelForCausalLM

    from megarl.models import load_model
    from megarl.tools.logprobs import sequence_logprobs
    from megarl.tools.make_tiny_model import make_tiny_model

    # Made afresh every run (seconds): a model cached from an older make_tiny_model could hide a change.
    make_tiny_model(family, model_dir, vocab_size=301)
    sequences = [torch.randint(0, 301, (n,), generator=gen).tolist() for n in lengths]
    dtype = "bfloat16" if gpu else "float32"
    model, spec = load_model(model_dir, dims, dtype=dtype)
    model.eval()
    mine = sequence_logprobs(model, spec, dims, sequences, micro_batch_size=4)
    del model
    device = "cuda" if gpu else "cpu"

    def hf(torch_dtype) -> list[list[float]]:
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
        out = []
        with torch.no_grad():
            for s in sequences:
                ids = torch.tensor([s], device=device)
                logp = torch.log_softmax(m(ids).logits[0].float(), -1)
                out.append(logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist())
        return out

    ref = hf(torch.float32)
    hf_low = hf(torch.bfloat16) if gpu else ref

    def gap(a, b) -> dict:
        d = torch.tensor([x - y for sa, sb in zip(a, b) for x, y in zip(sa, sb)]).abs()
        return {"max_abs": float(f"{float(d.max()):.4g}"), "mean_abs": float(f"{float(d.mean()):.4g}")}

    mine_gap, hf_gap = gap(mine, ref), gap(hf_low, ref)
    if gpu:
        ok = (mine_gap["mean_abs"] <= 2 * hf_gap["mean_abs"] + 0.01 and mine_gap["max_abs"] <= 2 * hf_gap["max_abs"] + 0.05)
    else:
        ok = mine_gap["max_abs"] <= 1e-4
    return {"ok": ok, "moe": spec.is_moe, "dtype": dtype, "tokens": sum(n - 1 for n in lengths),
            "megarl_vs_transformers_fp32": mine_gap, "transformers_bf16_vs_fp32": hf_gap if gpu else None}


def delta_on_device(args, gpu: bool, save) -> dict:
    import delta_sync as bench
    from overhead import timed

    from megarl.hybrid import delta

    device = torch.device("cuda" if gpu else "cpu")
    bench.DEVICE = device  # the benchmark's PPO update runs where its model is
    result: dict = {"check": "delta weight sync on the device (issue 42)", "lrs": {}, "complete": False, "ok": False}

    def bf16_bytes(model):
        return {n: p.detach().to(torch.bfloat16).contiguous().view(-1).view(torch.uint8) for n, p in model.named_parameters()}

    steps = 3 if args.tiny else 10
    for lr in (1e-6, 1e-5):
        full_bytes = sent = changed = elements = 0
        encode_s = apply_s = copy_s = 0.0
        for kind in ("dense", "moe"):
            model = bench.build_model(kind, 1, args.tiny).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
            vocab = model.config.vocab_size
            last, receiver = bf16_bytes(model), bf16_bytes(model)  # after the first (full) sync both ends hold the same
            for step in range(1, steps + 1):
                bench.ppo_update(model, opt, step, 4, 48, vocab)
                new = bf16_bytes(model)
                for name, seg in new.items():
                    pieces = [delta.Piece(0, seg.numel(), 2)]
                    encoded: list = []
                    t_enc = timed(lambda: encoded.append(delta.encode(seg, last[name], pieces)), gpu)
                    enc = encoded[0]
                    t_copy = timed(lambda: receiver[name].copy_(seg), gpu)  # what full mode does with the bytes
                    receiver[name].copy_(last[name])  # back to the receiver's state before this sync
                    if enc.payload is None:  # denser than the break-even: the segment goes whole
                        t_app = t_copy
                        receiver[name].copy_(seg)
                        sent += seg.numel()
                    else:
                        t_app = timed(lambda: delta.apply(receiver[name], enc.encoding, enc.changed, enc.payload, pieces), gpu)
                        sent += enc.payload.numel()
                    if not torch.equal(receiver[name], seg):
                        raise AssertionError(f"{kind} lr {lr:g} step {step}: {name} after the delta differs from the full copy")
                    full_bytes += seg.numel()
                    changed += enc.changed
                    elements += enc.elements
                    encode_s, apply_s, copy_s = encode_s + t_enc, apply_s + t_app, copy_s + t_copy
                last = new
            del model, opt
        saved = full_bytes - sent
        result["lrs"][f"{lr:g}"] = {
            "bytes_over_full": round(sent / full_bytes, 4), "changed_fraction": round(changed / elements, 5),
            "full_bytes_per_sync": full_bytes // steps, "encode_gbps": round(full_bytes / encode_s / 1e9, 3),
            "apply_gbps": round(full_bytes / apply_s / 1e9, 3), "device_copy_gbps": round(full_bytes / copy_s / 1e9, 3),
            "break_even_link_gbps": round(saved / (encode_s + apply_s) / 1e9, 3) if saved > 0 else 0.0}
        save(result)
    result.update(complete=True, ok=True, steps=steps, device=str(device),
                  models="TinyLlama-1.1B layer shapes and a small-expert Qwen2-MoE, 1 layer each (benchmarks/delta_sync.py)")
    save(result)
    return result


def environment(gpu: bool) -> dict:
    import megatron.core

    return {
        "device": torch.cuda.get_device_name() if gpu else platform.machine(),
        "torch": torch.__version__, "python": platform.python_version(),
        "megatron_core": getattr(megatron.core, "__version__", "?"),
        "transformer_engine_installed": importlib.util.find_spec("transformer_engine") is not None,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    raise SystemExit(main())
