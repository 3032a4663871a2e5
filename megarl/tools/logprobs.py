"""Per-token log-probs of token sequences under a Megatron-Core model loaded from an HF directory
(or a hub id, `org/name[@revision]`, fetched into the Hugging Face cache once per node).

    torchrun --nproc_per_node N -m megarl.tools.logprobs --model DIR --tp T --pp P [--ep E] [--etp E] \
        [--vpp V] [--first-stage-layers F] [--last-stage-layers L] [--cp C] \
        --input in.jsonl --output out.jsonl [--dtype float32|bfloat16]

Each input line is {"input_ids": [...]}; each output line is {"logprobs": [...]} with
len(input_ids) - 1 values, value i being log p(input_ids[i+1] | input_ids[:i+1]). Use it to debug
train / inference mismatches: run it under the training layout and compare with the rollout engine.
With `--cp C` (context parallelism) the sequences run packed, split over the CP ranks as training
splits them (`megarl.engine.context_parallel`), through the engine's forward-only pass.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import hub
from megarl.data.batching import pad_right
from megarl.distributed.parallel import dims_from_env
from megarl.engine.batch import SequenceBatch
from megarl.engine.engine import EngineConfig, MegatronEngine
from megarl.engine.forward import pipeline_forward
from megarl.layout import ModelShape, check_model
from megarl.models import load_model_chunks
from megarl.models.families import load_spec
from megarl.models.sequence_parallel import sequence_multiple
from megarl.models.vocab_parallel import vocab_parallel_logprobs


def read_jsonl_ids(path: str, vocab_size: int | None = None) -> list[list[int]]:
    """Token-id lists of a JSONL file of {"input_ids": [...]}; errors name file:line."""
    sequences = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["input_ids"]
            except (json.JSONDecodeError, KeyError, TypeError):
                ids = None
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{path}:{n}: expected a JSON object with an 'input_ids' list of integers")
            if len(ids) < 2:
                raise ValueError(f"{path}:{n}: input_ids needs at least 2 tokens to have a log-prob")
            # An id past the vocabulary either fails inside the embedding or, with TP padding, reads a
            # padding row and yields a meaningless log-prob.
            bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                where = "negative" if vocab_size is None else f"outside the vocabulary [0, {vocab_size})"
                raise ValueError(f"{path}:{n}: token id {bad[0]} is {where}")
            sequences.append(ids)
    if not sequences:
        raise ValueError(f"{path} holds no input_ids lines")
    return sequences


def sequence_logprobs(model, spec, dims, sequences: list[list[int]], micro_batch_size: int = 4, length: int | None = None, num_micro_batches: int | None = None) -> list[list[float]]:
    """Log-probs of each sequence (this rank computes all of them; callers split over DP).
    `model` is this rank's model, or its list of chunks with virtual pipeline stages.

    `length` and `num_micro_batches` must be equal on every rank of an expert-parallel group: MoE
    layers exchange tokens across it, so every replica runs the same shapes.
    """
    n = len(sequences)
    length = length or max(len(s) for s in sequences)
    multiple = sequence_multiple(dims)  # sequence parallelism splits the sequence over TP
    length = multiple * -(-length // multiple)
    num_micro_batches = num_micro_batches or -(-n // micro_batch_size)
    ids, _ = pad_right(sequences, pad_id=0, length=length) if sequences else (torch.zeros(0, length, dtype=torch.long), None)
    pad_rows = num_micro_batches * micro_batch_size - n  # the pipeline needs equal micro-batches
    ids = torch.cat([ids, torch.zeros(pad_rows, ids.shape[1], dtype=ids.dtype)])
    first = model[0] if isinstance(model, (list, tuple)) else model
    device = next(first.parameters()).device
    micro_batches = [{"input_ids": ids[i : i + micro_batch_size].to(device)} for i in range(0, len(ids), micro_batch_size)]

    def compute(logits, mb):
        lp = vocab_parallel_logprobs(logits[:, :-1].float(), mb["input_ids"][:, 1:], dims.tp_group if dims.tp > 1 else None, true_vocab_size=spec.vocab_size)
        return {"logprobs": lp}

    outputs = pipeline_forward(model, dims, micro_batches, compute)
    all_lp = torch.cat([o["logprobs"] for o in outputs])[:n].cpu()
    return [all_lp[i, : len(s) - 1].tolist() for i, s in enumerate(sequences)]


def packed_logprobs(model_dir: str, dims, dtype: str, sequences: list[list[int]], tokens_per_micro_batch: int) -> list[list[float]]:
    """Log-probs of each sequence through the engine's packed forward-only pass (what training runs,
    context parallelism included): every token after the first is a "response" token."""
    engine = MegatronEngine(model_dir, dims, EngineConfig(dtype=dtype, max_tokens_per_microbatch=tokens_per_micro_batch),
                            trainable=False)
    width = max((len(s) for s in sequences), default=2) - 1
    mask = torch.tensor([[1.0] * (len(s) - 1) + [0.0] * (width - len(s) + 1) for s in sequences]).reshape(len(sequences), width)
    batch = SequenceBatch(sequences, [1] * len(sequences), list(range(len(sequences))), width, {"response_mask": mask})
    lp = engine.forward_only(batch).logprobs
    return [lp[i, : len(s) - 1].tolist() for i, s in enumerate(sequences)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="per-token log-probs under a Megatron-Core model")
    p.add_argument("--model", required=True, help="a Hugging Face model directory or hub id (org/name[@revision])")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallelism (default: --tp)")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank (interleaved 1F1B)")
    p.add_argument("--first-stage-layers", type=int, default=None, help="layers of the first pipeline stage (uneven stages)")
    p.add_argument("--last-stage-layers", type=int, default=None, help="layers of the last pipeline stage (uneven stages)")
    p.add_argument("--cp", type=int, default=1, help="context parallelism (packed sequences, as in training)")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--micro-batch-size", type=int, default=4)
    args = p.parse_args(argv)

    try:
        if args.cp > 1 and args.pp > 1:
            raise ValueError(f"--cp {args.cp} with --pp {args.pp} is not built yet; use --pp 1 with context parallelism")
        dims = dims_from_env(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=args.etp, vpp=args.vpp,
                             first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers,
                             sequence_parallel=True)  # at tp > 1, as training runs by default
        # a hub id is fetched once per node, which needs the process group: started here for it
        model_dir = hub.local_path_on_each_node(args.model, "--model", dims.initialize)
        spec = load_spec(model_dir)  # UnsupportedModelError is a ValueError
        sequences = read_jsonl_ids(args.input, spec.vocab_size)
        check_model(ModelShape.of_spec(spec), dims.layout)  # forward only: MoE at tp > 1 is fine here
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not dims.initialized:  # a hub id started the process groups above; otherwise they start here
        dims.initialize()
    # Data parallel: replica r handles sequences r, r + dp, ...; results meet on every rank.
    mine = list(range(dims.dp_rank, len(sequences), dims.dp))
    per_replica = -(-len(sequences) // dims.dp)
    if dims.cp > 1:
        lps = packed_logprobs(model_dir, dims, args.dtype, [sequences[i] for i in mine],
                              args.micro_batch_size * max(len(s) for s in sequences))
    else:
        model, spec = load_model_chunks(model_dir, dims, dtype=args.dtype)
        for chunk in model:
            chunk.eval()
        lps = sequence_logprobs(
            model, spec, dims, [sequences[i] for i in mine], args.micro_batch_size,
            length=max(len(s) for s in sequences), num_micro_batches=-(-per_replica // args.micro_batch_size),
        )
    gathered: list = [None] * dims.world_size
    dist.all_gather_object(gathered, dict(zip(mine, lps)))
    if dims.rank == 0:
        merged = {}
        for part in gathered:
            merged.update(part)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w") as f:
            for i in range(len(sequences)):
                f.write(json.dumps({"logprobs": merged[i]}) + "\n")
    dist.barrier()
    dims.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
