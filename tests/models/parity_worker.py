"""Run under torchrun by tests/models/test_parity*.py: for each (model, layout) it checks

  1. log-probs of Megatron-Core (megarl.tools.logprobs' function) against transformers, float32;
  2. the HF -> mcore -> HF round trip, bit-exact (dtypes too), against the safetensors files, with
     multi-token-prediction layers skipped and never exported;
  3. that the ranks' `local_weight_shards` (the hybrid weight sync's input) hold every weight.

A layout is a `tp,pp,ep` triple (`2,1,1`) or `key=value` pairs (`pp=2,first=1,last=3`; keys tp, pp,
ep, etp, vpp, first, last, sp: 1 = sequence parallelism); `@0,2` after it restricts it to those models (indices into --models).
One torchrun launch serves many layouts (process groups are rebuilt per layout), because starting
processes costs more than the tiny models' compute. Results go to --out as JSON from rank 0.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

KEYS = {"tp": "tp", "pp": "pp", "ep": "ep", "etp": "etp", "vpp": "vpp", "first": "first_stage_layers", "last": "last_stage_layers",
        "sp": "sequence_parallel"}


def parse_layout(text: str) -> tuple[dict, set[int] | None]:
    """('tp=2,ep=2@1,3' or '2,1,2') -> (dims_from_env keyword arguments, model indices or None = all)."""
    text, _, only = text.partition("@")
    models = {int(i) for i in only.split(",")} if only else None
    if "=" not in text:
        tp, pp, ep = (int(x) for x in text.split(","))
        return dict(tp=tp, pp=pp, ep=ep), models
    return {KEYS[k]: int(v) for k, v in (part.split("=") for part in text.split(","))}, models


def hf_reference(model_dir: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for seq in sequences:
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            out.append(logp[:-1].gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1))
    return out


def logprobs_and_export(chunks, spec, dims, sequences, reference, source) -> tuple[float, int, list[str], set[str]]:
    """One layout's checks against the checkpoint: the largest |log-prob - transformers'| over every
    rank (each data-parallel replica scores its share of `sequences`, 2 per micro-batch), then the
    export compared tensor by tensor with the checkpoint, values and dtypes (the float32 correction
    bias must stay float32). Returns (max diff, tensors exported, mismatched names, exported names)."""
    from megarl.models.weights import export_hf
    from megarl.tools.logprobs import sequence_logprobs

    mine = list(range(dims.dp_rank, len(sequences), dims.dp))
    per_replica = -(-len(sequences) // dims.dp)
    # micro-batches of 2: under vpp the schedule needs a multiple of pp of them (filled up)
    lps = sequence_logprobs(chunks, spec, dims, [sequences[i] for i in mine], 2,
                            length=16, num_micro_batches=-(-per_replica // 2))
    diffs = [(torch.tensor(lp) - reference[i]).abs().max().item() for i, lp in zip(mine, lps)]
    max_diff = torch.tensor(max(diffs) if diffs else 0.0, dtype=torch.float64)
    dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
    exported, mismatched, names = 0, [], set()
    for name, tensor in export_hf(chunks, spec, dims):
        exported += 1
        names.add(name)
        if tensor.dtype != source.full(name).dtype or not torch.equal(tensor, source.full(name)):
            mismatched.append(name)
    return max_diff.item(), exported, mismatched, names


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", required=True, help="tp,pp,ep triples like 2,1,1 or key=value lists, each optionally @model,indices")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megarl.models import load_model_chunks
    from megarl.models.convert import exported_mappings, mtp_tensor_names
    from megarl.models.families import load_spec
    from megarl.models.weights import SafetensorsDir, local_weight_shards
    from megarl.distributed.parallel import dims_from_env

    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 301, (n,), generator=gen).tolist() for n in (7, 12, 3, 9, 16)]
    results = []
    for index, model_dir in enumerate(args.models):
        spec = load_spec(model_dir)
        layouts = [(text, *parse_layout(text)) for text in args.layouts]
        layouts = [(text, layout) for text, layout, only in layouts if only is None or index in only]
        layouts = [(text, layout) for text, layout in layouts if spec.is_moe or (layout.get("ep", 1) == 1 and "etp" not in layout)]
        if not layouts:
            continue
        reference = hf_reference(model_dir, sequences)
        source = SafetensorsDir(model_dir)
        for text, layout in layouts:
            dims = dims_from_env(**layout).initialize()
            chunks, _ = load_model_chunks(model_dir, dims)
            for chunk in chunks:
                chunk.eval()
            max_diff, exported, mismatched, names = logprobs_and_export(chunks, spec, dims, sequences, reference, source)
            # multi-token-prediction layers are skipped on load and must not come back on export
            mtp = set(mtp_tensor_names(spec, source.weight_map))
            missing = sorted(set(source.weight_map) - names - mtp)
            held: list = [None] * dims.world_size
            dist.all_gather_object(held, sorted(local_weight_shards(chunks, spec, dims)))
            # (a tied output layer is the embedding: exported_mappings leaves it out)
            unheld = sorted({m.name for m in exported_mappings(spec, dims.tp)} - {n for part in held for n in part})
            tp, pp, ep = (layout.get(k, 1) for k in ("tp", "pp", "ep"))
            results.append(dict(model=spec.family, model_dir=model_dir, layout=text, tp=tp, pp=pp, ep=ep, sp=dims.sequence_parallel,
                                chunks=len(chunks), max_abs_diff=max_diff, exported=exported,
                                mismatched=mismatched, missing=missing, unheld=unheld,
                                mtp_skipped=len(mtp), mtp_exported=sorted(mtp & names)))
            dims.destroy()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
