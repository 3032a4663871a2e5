"""Micro-batches of one forward/backward call: which sequences go together, and their tensors.

Two layouts share one plan format:
- **packed** (padding removed, verl's `use_remove_padding`): a micro-batch is one row `[1, width]`
  with its sequences laid end to end and their boundaries in `PackedSeqParams` (Megatron's `thd`
  format). Sequences are spread over the micro-batches by length so the token loads are even; the
  only padding is each row's tail, one segment of its own.
- **padded**: a micro-batch is `[rows, width]`, each sequence right-padded to the longest of
  the step. Right padding needs no mask: attention is causal, so a pad never influences an earlier
  position.

Every DP rank must run the same number of micro-batches of the same shape: pipeline stages
exchange fixed-shape activations, and MoE layers exchange tokens across the expert-parallel group,
which spans DP ranks. `agree_max` takes the element-wise maximum over the DP group.

Per-token outputs are addressed by `positions`: for each row's response token j, the index into the
micro-batch's flattened outputs of the position that predicts it (see `megarl.engine.batch`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megarl.engine.batch import SequenceBatch, response_positions

AgreeMax = Callable[[list[int]], list[int]]
FILLER = [0, 0]  # the sequence of a filler row (None): two pad tokens, nothing of it is trained


@dataclass
class Plan:
    bins: list[list[int | None]]  # batch rows per micro-batch; None = a filler row, masked out
    width: int  # tokens per row: the packed micro-batch length, or the padded sequence length
    packed: bool
    seq_multiple: int = 1  # packed: each sequence padded at its end to a multiple (2*cp under context parallelism)

    def padding_fraction(self, lengths: Sequence[int]) -> float:
        """Share of the planned token slots (rows x width; a packed micro-batch is one row) that no
        real token of `lengths` fills."""
        rows = len(self.bins) if self.packed else sum(len(b) for b in self.bins)
        slots = rows * self.width
        real = sum(lengths[r] for b in self.bins for r in b if r is not None)
        return 1.0 - real / slots


def balanced_bins(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Indices of `lengths` in k bins of near-equal total: longest first, each into the lightest bin
    (ties: the bin with fewer sequences, then the lower index). Each bin is in index order."""
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(k), key=lambda b: (loads[b], len(bins[b]), b))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def _fits(lengths: Sequence[int], bins: list[list[int]], budget: int) -> bool:
    # A sequence longer than the budget gets a micro-batch of its own (the budget bounds memory;
    # a sequence cannot be split), so only bins of two or more must respect it.
    return all(len(b) <= 1 or sum(lengths[i] for i in b) <= budget for b in bins)


def plan_packed(lengths: Sequence[int], budget: int, agree_max: AgreeMax, multiple: int = 1) -> Plan:
    """Fewest micro-batches (equal on every DP rank) whose packed lengths stay within `budget`."""
    # Lower bound: each oversized sequence alone, the rest at least ceil(total / budget) bins.
    oversized = [n for n in lengths if n > budget]
    k = max(1, len(oversized) + math.ceil((sum(lengths) - sum(oversized)) / budget))
    while not _fits(lengths, balanced_bins(lengths, k), budget):
        k += 1
    [k] = agree_max([k])
    while True:  # balancing into more bins than a rank needed can still overflow one: retry together
        bins = balanced_bins(lengths, k)
        [agreed] = agree_max([k + (not _fits(lengths, bins, budget))])
        if agreed == k:
            break
        k = agreed
    rows: list[list[int | None]] = [list(b) if b else [None] for b in bins]
    loads = [sum(lengths[r] if r is not None else len(FILLER) for r in b) for b in rows]
    [width] = agree_max([max(loads)])
    return Plan(rows, multiple * math.ceil(width / multiple), packed=True)


def plan_padded(lengths: Sequence[int], budget: int, agree_max: AgreeMax, multiple: int = 1) -> Plan:
    """Rows in order over the fewest micro-batches the budget allows at the step's longest length,
    spread evenly: every micro-batch has ceil(rows / micro-batches) rows, so filler rows (which keep
    the shapes equal for pipeline stages and across DP ranks) number fewer than the micro-batches.
    Filling each micro-batch to the budget instead made a cliff: 32 rows at 30 per micro-batch
    became 2 x 30 rows, 28 of them filler. `multiple`: the width is rounded up to it (tp under
    sequence parallelism, which splits the sequence dimension over TP)."""
    width, count = agree_max([max(lengths, default=len(FILLER)), len(lengths)])
    width = multiple * math.ceil(width / multiple)
    num = max(1, math.ceil(count / max(1, min(count, budget // width))))
    per_mb = max(1, math.ceil(count / num))
    rows: list[int | None] = list(range(len(lengths))) + [None] * (num * per_mb - len(lengths))
    return Plan([rows[k * per_mb : (k + 1) * per_mb] for k in range(num)], width, packed=False)


def build(plan: Plan, batch: SequenceBatch, rows: Sequence[int], fields: Sequence[str], device: torch.device) -> list[dict]:
    """Tensors of each planned micro-batch; plan entries index `rows`, which index `batch`."""
    out = []
    for entries in plan.bins:
        chunk = [rows[e] if e is not None else None for e in entries]
        seqs = [batch.input_ids[r] if r is not None else FILLER for r in chunk]
        prompt_lens = torch.tensor([batch.prompt_lens[r] if r is not None else 1 for r in chunk])
        seq_lens = torch.tensor([len(s) for s in seqs])
        within = response_positions(prompt_lens, batch.response_len, seq_lens)  # [rows, R]
        mb, starts = _packed(seqs, plan.width, device, plan.seq_multiple) if plan.packed else _padded(seqs, plan.width, device)
        mb["positions"] = within + starts.unsqueeze(1)
        mb["rows"] = chunk
        # One gather per field (a stack of per-row slices cost 3 ms per demo mini-batch); filler rows are zeros.
        real = [i for i, r in enumerate(chunk) if r is not None]
        source = torch.tensor([chunk[i] for i in real], dtype=torch.long)
        for name in dict.fromkeys(tuple(fields) + ("response_mask",)):
            t = batch.tensors[name]
            if len(real) == len(chunk):
                rows_t = t[source]
            else:
                rows_t = t.new_zeros((len(chunk), *t.shape[1:]))
                rows_t[real] = t[source]
            mb[name] = rows_t.to(device)
            if name == "response_mask":  # counted here, on the host: the loss needs no device sync for it
                mb["response_tokens"] = float(rows_t.sum())
        out.append(mb)
    return out


def _padded(seqs: list[list[int]], width: int, device) -> tuple[dict, torch.Tensor]:
    """The micro-batch's model inputs, and where each sequence starts in its flattened outputs."""
    # One scatter of all tokens (a tensor per row cost 4.7% of the demo's time).
    lens = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    ids[torch.arange(width) < lens.unsqueeze(1)] = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    return {"input_ids": ids.to(device)}, torch.arange(len(seqs)) * width


def _packed(seqs: list[list[int]], width: int, device, seq_multiple: int = 1) -> tuple[dict, torch.Tensor]:
    """As `_padded`, for one packed row; each sequence's segment padded at its end to `seq_multiple`."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.packed_seq_params import PackedSeqParams

    if seq_multiple > 1:  # context parallelism: pads inside the segment, after its real tokens
        seqs = [s + [0] * (-len(s) % seq_multiple) for s in seqs]
    lens = [len(s) for s in seqs]
    used = sum(lens)
    # The tail padding is made of segments too, none longer than the longest sequence: one long pad
    # segment would set the attention width of the whole row (quadratic in it, on the local path).
    pad, longest = width - used, max(lens)
    segments = lens + [longest] * (pad // longest) + ([pad % longest] if pad % longest else [])
    ids = torch.zeros(1, width, dtype=torch.long)
    ids[0, :used] = torch.as_tensor([t for s in seqs for t in s], dtype=torch.long)
    # Positions restart at every sequence; RoPE takes them from cu_seqlens, absolute position
    # embeddings (none of our families) from position_ids.
    position_ids = torch.cat([torch.arange(n) for n in segments]).unsqueeze(0)
    cu = torch.tensor([0] + segments, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(segments), max_seqlen_kv=max(segments))
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    return {"input_ids": ids.to(device), "position_ids": position_ids.to(device), "packed_seq_params": params}, starts
