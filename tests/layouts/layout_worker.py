"""Run under torchrun by tests/layouts/test_layouts.py: for each (model, layout) it checks, like
tests/models/parity_worker.py but for the layouts of issue 14 (uneven stages, virtual stages,
expert tensor parallelism):

  1. `megarl.tools.logprobs`' function against transformers, float32;
  2. the HF -> mcore -> HF round trip, bit-exact, against the safetensors files;
  3. that the ranks' `local_weight_shards` (the input of the hybrid weight sync) together hold
     every weight, each under the global name of its layer.

A layout is `key=value` pairs joined by commas: tp, pp, ep, etp, vpp, first, last
(e.g. `pp=2,first=1,last=3`). One torchrun launch serves every layout. JSON to --out from rank 0.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

KEYS = {"tp": "tp", "pp": "pp", "ep": "ep", "etp": "etp", "vpp": "vpp", "first": "first_stage_layers", "last": "last_stage_layers"}


def parse_layout(text: str) -> dict:
    out = {}
    for part in text.split(","):
        key, value = part.split("=")
        out[KEYS[key]] = int(value)
    return out


def hf_reference(model_dir: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for seq in sequences:
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            out.append(logp[:-1].gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cli", default=None,
                   help="after the layouts: run `megarl.tools.logprobs` with these (shell-quoted) arguments; it ends the process group")
    args = p.parse_args()

    from megarl.models import load_model_chunks
    from megarl.models.convert import weight_mappings
    from megarl.models.families import load_spec
    from megarl.models.weights import SafetensorsDir, export_hf, local_weight_shards
    from megarl.parallel import dims_from_env
    from megarl.tools.logprobs import sequence_logprobs

    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 301, (n,), generator=gen).tolist() for n in (7, 12, 3, 9, 16, 5)]
    results = []
    for model_dir in args.models:
        spec = load_spec(model_dir)
        reference = hf_reference(model_dir, sequences)
        source = SafetensorsDir(model_dir)
        for text in args.layouts:
            layout = parse_layout(text)
            if (layout.get("ep", 1) > 1 or "etp" in layout) and not spec.is_moe:
                continue
            dims = dims_from_env(**layout).initialize()
            chunks, _ = load_model_chunks(model_dir, dims)
            for chunk in chunks:
                chunk.eval()
            mine = list(range(dims.dp_rank, len(sequences), dims.dp))
            per_replica = -(-len(sequences) // dims.dp)
            # 3 micro-batches of 2 per replica: under vpp the schedule needs a multiple of pp (filled up)
            lps = sequence_logprobs(chunks, spec, dims, [sequences[i] for i in mine], 2,
                                    length=16, num_micro_batches=-(-per_replica // 2))
            diffs = [(torch.tensor(lp) - reference[i]).abs().max().item() for i, lp in zip(mine, lps)]
            max_diff = torch.tensor(max(diffs) if diffs else 0.0, dtype=torch.float64)
            dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
            exported, mismatched, names = 0, [], set()
            for name, tensor in export_hf(chunks, spec, dims):
                exported += 1
                names.add(name)
                if not torch.equal(tensor, source.full(name)):
                    mismatched.append(name)
            missing = sorted(set(source.weight_map) - names)
            # Each chunk holds the layers megarl's arithmetic says (Megatron built them from its own).
            from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

            built = [range(get_transformer_layer_offset(c.config, c.vp_stage), get_transformer_layer_offset(c.config, c.vp_stage)
                           + len(c.decoder.layers)) for c in chunks]
            expected = [dims.chunk_layers(spec.num_layers)[(dims.pp_rank, v)] for v in range(len(chunks))]
            layers_ok = torch.tensor(int(built == expected))
            dist.all_reduce(layers_ok, op=dist.ReduceOp.MIN)
            held: list = [None] * dims.world_size
            dist.all_gather_object(held, sorted(local_weight_shards(chunks, spec, dims)))
            unheld = sorted({m.name for m in weight_mappings(spec, dims.tp)} - {n for part in held for n in part})
            results.append(dict(model=spec.family, layout=text, chunks=len(chunks), layers_ok=bool(layers_ok), max_abs_diff=max_diff.item(),
                                exported=exported, mismatched=mismatched, missing=missing, unheld=unheld))
            dims.destroy()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    if args.cli is not None:
        from megarl.tools.logprobs import main as logprobs_main

        import shlex

        raise SystemExit(logprobs_main(shlex.split(args.cli)))  # the command line, in the same torchrun world
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
