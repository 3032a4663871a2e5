"""Run under torchrun by tests/models/test_parity.py: for each (model, layout) it checks

  1. log-probs of Megatron-Core (megarl.tools.logprobs' function) against transformers, float32;
  2. the HF -> mcore -> HF round trip, bit-exact, against the safetensors files.

One torchrun launch serves many layouts (process groups are rebuilt per layout), because starting
processes costs more than the tiny models' compute. Results go to --out as JSON from rank 0.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


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
    p.add_argument("--layouts", nargs="+", required=True, help="tp,pp,ep triples like 2,1,1")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from megarl.models import load_model
    from megarl.models.convert import mtp_tensor_names
    from megarl.models.families import load_spec
    from megarl.models.weights import SafetensorsDir, export_hf
    from megarl.parallel import dims_from_env
    from megarl.tools.logprobs import sequence_logprobs

    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 301, (n,), generator=gen).tolist() for n in (7, 12, 3, 9, 16)]
    results = []
    for model_dir in args.models:
        spec = load_spec(model_dir)
        reference = hf_reference(model_dir, sequences)
        source = SafetensorsDir(model_dir)
        for layout in args.layouts:
            tp, pp, ep = (int(x) for x in layout.split(","))
            if ep > 1 and not spec.is_moe:
                continue
            dims = dims_from_env(tp=tp, pp=pp, ep=ep).initialize()
            model, _ = load_model(model_dir, dims)
            model.eval()
            mine = list(range(dims.dp_rank, len(sequences), dims.dp))
            per_replica = -(-len(sequences) // dims.dp)
            lps = sequence_logprobs(model, spec, dims, [sequences[i] for i in mine], 2,
                                    length=16, num_micro_batches=-(-per_replica // 2))
            diffs = [(torch.tensor(lp) - reference[i]).abs().max().item() for i, lp in zip(mine, lps)]
            max_diff = torch.tensor(max(diffs) if diffs else 0.0, dtype=torch.float64)
            dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
            exported, mismatched, names = 0, [], set()
            for name, tensor in export_hf(model, spec, dims):
                exported += 1
                names.add(name)
                # torch.equal also compares dtypes: the float32 correction bias must stay float32
                if tensor.dtype != source.full(name).dtype or not torch.equal(tensor, source.full(name)):
                    mismatched.append(name)
            # multi-token-prediction layers are skipped on load and must not come back on export
            mtp = set(mtp_tensor_names(spec, source.weight_map))
            missing = sorted(set(source.weight_map) - names - mtp)
            results.append(dict(model=spec.family, tp=tp, pp=pp, ep=ep, max_abs_diff=max_diff.item(),
                                 exported=exported, mismatched=mismatched, missing=missing,
                                 mtp_skipped=len(mtp), mtp_exported=sorted(mtp & names),
                                 model_dir=model_dir))
            dims.destroy()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
