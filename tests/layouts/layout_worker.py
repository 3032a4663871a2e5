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
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from parity_worker import hf_reference, logprobs_and_export  # noqa: E402  (the same checks as the families' parity)

KEYS = {"tp": "tp", "pp": "pp", "ep": "ep", "etp": "etp", "vpp": "vpp", "first": "first_stage_layers", "last": "last_stage_layers"}


def parse_layout(text: str) -> dict:
    out = {}
    for part in text.split(","):
        key, value = part.split("=")
        out[KEYS[key]] = int(value)
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
    from megarl.models.weights import SafetensorsDir, local_weight_shards
    from megarl.distributed.parallel import dims_from_env

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
            max_diff, exported, mismatched, names = logprobs_and_export(chunks, spec, dims, sequences, reference, source)
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
            results.append(dict(model=spec.family, layout=text, chunks=len(chunks), layers_ok=bool(layers_ok), max_abs_diff=max_diff,
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
