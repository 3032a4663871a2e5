"""Micro-batches and per-token outputs under context parallelism (`parallel.cp`).

The CP ranks of one data-parallel rank share its sequences and its micro-batch plan (they have the
same `dp_rank`); each runs the model on its share of every packed row:

- **Layout** (`megarl.engine.micro_batches` with `seq_multiple = 2*cp`): every sequence is padded
  at its end, inside its own segment, to a multiple of 2*cp, and the row's width to a multiple of
  lcm(8*tp, 2*cp*tp). Pads after the real tokens never reach them (causal attention), which is
  why TE#1929's masked-pad-inside-a-CP-chunk trap does not arise.
- **Split** (`shard`): the row's tokens of this rank (`megarl.models.context_parallel.cp_index`);
  `PackedSeqParams` keeps the *global* padded boundaries (`cu_seqlens_*_padded` too, which
  Megatron's thd RoPE and TE's CP attention read) and the global max length. The full ids stay as
  `full_input_ids` for the targets: labels are taken before the split, never rolled after it
  (verl#4250). Routing-replay routes are split the same way, then (sequence parallelism) cut into
  the tp contiguous blocks of this rank's tokens that its TP ranks' routers see.
- **Outputs** (`select` / `spread`): each rank computes log-probs, entropy or values for the
  response positions it holds, scatters them into a zero `[rows, R]` tensor and sums it over the
  CP group, forward only (identity backward). Every CP rank then holds the same full tensor and
  computes the same loss; its graph reaches only its own tokens, so DDP's sum over dp x cp of the
  `dp * cp`-scaled loss (`MegatronEngine.train_step`) is exactly the one-process gradient. A
  backward that all-reduced too would give cp-times gradients (NeMo-RL's AllGatherCPTensor is
  paired with a different loss scaling). Metrics and totals reduce over the DP group, which
  excludes CP: counted once.

The token budget (`max_tokens_per_microbatch`) counts the CP group's tokens: each GPU holds 1/cp.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megarl.distributed.parallel import all_gather_host
from megarl.models.context_parallel import cp_index
from megarl.models.moe_routing import ROUTES, sequence_parallel_shard
from megarl.models.vocab_parallel import _AllReduceSumReplicatedOutput


def padded_length(n: int, cp: int) -> int:
    """A sequence's length in the packed row: a multiple of 2*cp (unchanged at cp=1)."""
    return n if cp == 1 else 2 * cp * math.ceil(n / (2 * cp))


def width_multiple(tp: int, cp: int) -> int:
    """Row widths: divisible by 8*tp (sequence-parallel splits, tensor-core shapes) and by 2*cp*tp."""
    return math.lcm(8 * tp, 2 * cp * tp)


def shard(mb: dict, cp: int, rank: int, sp_shard: tuple[int, int] | None = None) -> None:
    """Turn a built packed micro-batch (global row) into this CP rank's, in place. sp_shard:
    (tp rank, tp) under sequence parallelism, whose routers see the tp-rank-th contiguous block
    of this CP rank's tokens (so the routes are split by CP first, then by SP)."""
    params = mb["packed_seq_params"]
    cu = params.cu_seqlens_q
    idx = cp_index(cu.cpu(), cp, rank).to(mb["input_ids"].device)
    width = mb["input_ids"].shape[1]
    mb["full_input_ids"] = mb["input_ids"]
    mb["input_ids"] = mb["input_ids"][:, idx]
    mb["position_ids"] = mb["position_ids"][:, idx]
    params.cu_seqlens_q_padded = cu
    params.cu_seqlens_kv_padded = params.cu_seqlens_kv
    local_of = torch.full((width,), -1, dtype=torch.long)
    local_of[idx.cpu()] = torch.arange(len(idx))
    mb["cp_local_of"] = local_of
    mb["cp_width"] = width
    if ROUTES in mb:  # [tokens, layers, topk] in row order (one packed row: token t is router token t)
        mb[ROUTES] = mb[ROUTES][idx]
        if sp_shard is not None:
            mb[ROUTES] = sequence_parallel_shard(mb[ROUTES], *sp_shard)


def check_same_batches(micro_batches: list[dict], group) -> None:
    """CP peers must hold the same sequences (one fingerprint gathered over the CP group)."""
    ids = [mb["full_input_ids"].reshape(-1).cpu().long() for mb in micro_batches]
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    weights = torch.arange(1, len(flat) + 1, dtype=torch.long) % 1000003
    mine = torch.tensor([len(flat), int((flat * weights).sum()), len(micro_batches)], dtype=torch.long)

    seen = all_gather_host(mine, group, dist.get_world_size(group))
    if any(not torch.equal(s, mine) for s in seen):
        raise RuntimeError("context parallelism: the CP ranks of one data-parallel rank were given different sequences "
                           "(each must train on its data-parallel rank's batch)")


def select(mb: dict, pos: torch.Tensor):
    """(owned [rows, R] bool, local rows [n] of the owned response positions, their targets [n])."""
    local_of = mb["cp_local_of"].to(pos.device)
    slot = local_of[pos]
    owned = slot >= 0
    targets = mb["full_input_ids"].reshape(-1)[pos[owned] + 1]  # position t predicts token t+1 of the full row
    return owned, slot[owned], targets


def spread(values: torch.Tensor, owned: torch.Tensor, group) -> torch.Tensor:
    """[n] values of the owned positions -> [rows, R] on every CP rank (sum over CP, identity backward)."""
    full = values.new_zeros(owned.shape).index_put(owned.nonzero(as_tuple=True), values)
    return _AllReduceSumReplicatedOutput.apply(full, group)
