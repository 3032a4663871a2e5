"""Routing replay (megarl.models.moe_routing; slime's `--use-routing-replay`, verl's "R3"): the
rollout engine records which experts every token was routed to in every MoE layer
(`RolloutResult.routed_experts`), and the actor's forward passes (old log-probs and the update) use
those experts instead of their own top-k.
Without it, a token whose router scores are nearly tied can go to different experts in the rollout
engine and in the actor (different kernels, bf16 logits in the engine against fp32 in the actor),
and its log-prob then differs by far more than float noise.

Routes travel as one int tensor per sequence, `[tokens, num_layers, topk]` (token-major, the layout
of vLLM's `CompletionOutput.routed_experts`): every decoder layer has a slot, the rows of dense
layers and of tokens nobody routed (the last response token, which the engine never fed back) are
-1, which means "route as the router decides". Such tokens influence no log-prob that depends on
the recorded ones (attention is causal; the last token predicts nothing that is scored).

Megatron-Core (0.16 to 0.19) has the hook: `TopKRouter` passes its `router_replay` attribute to
`topk_routing_with_score_function`, which calls `router_replay.get_replay_topk(scores, topk,
num_groups, group_topk, default_compute_topk)` in place of its own top-k, for softmax and sigmoid
scoring, group-limited or not, with or without the expert bias. Megatron's own `RouterReplay`
(`moe_enable_routing_replay`) does not fit as it is: it keeps every instance in one class-level
list shared by all models of the process (actor, reference, critic and reward model would mix),
and it leaves switching between forward and recompute replay to the caller. megarl installs its
own small object (`_LayerReplay`) on the actor's routers only; `model_forward` hands it each
micro-batch's routes. Because the hook is `TopKRouter`'s, every family that uses it (qwen3_moe,
mixtral, deepseek_v3, glm4_moe) is covered alike.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Sequence

import torch

from megarl.models.moe_routing.options import attached

ROUTES = "routes"  # micro-batch field: [router tokens, num_layers, topk] int, -1 = not recorded
_REPLAYS = "_megarl_route_replays"  # attribute of a model chunk: its routers' _LayerReplay objects


def install_replay(model: torch.nn.Module, found: list) -> None:
    """Install routing replay on `found`, the routers of `model` (one freshly built model chunk)."""
    setattr(model, _REPLAYS, [_LayerReplay(router) for router in found])


class _LayerReplay:
    """One router's replay: `get_replay_topk` is what Megatron's top-k routing calls."""

    def __init__(self, router):
        self.layer = router.layer_number - 1  # global, 0-based (layer_number includes the stage offset)
        # Full recomputation re-runs the router inside backward: it must replay the routes of the
        # micro-batch being recomputed, which schedules backward in forward order (FIFO).
        self.recomputes = router.config.recompute_granularity == "full"
        self.target: torch.Tensor | None = None  # [tokens, topk] of the micro-batch now in forward
        self.pending: deque = deque()  # targets of forwards whose backward will recompute
        self.used: torch.Tensor | None = None  # the indices of the last call (tests read them)
        router.router_replay = self

    def set_target(self, target: torch.Tensor | None) -> None:
        self.target = target
        if self.recomputes and torch.is_grad_enabled():
            self.pending.append(target)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        target = self.target
        if self.recomputes and torch._C._current_graph_task_id() != -1:  # inside autograd's backward
            target = self.pending.popleft() if self.pending else None
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if target is not None:
            target = target.to(indices.device)
            if target.shape != indices.shape:
                raise ValueError(f"routing replay: layer {self.layer} routes {tuple(indices.shape)} tokens x experts, "
                                 f"the recorded routes are {tuple(target.shape)}")
            known = (target >= 0).all(dim=-1, keepdim=True)
            indices = torch.where(known, target.long(), indices)
            values = scores.gather(1, indices)
        self.used = indices.detach()
        return values, indices


@contextmanager
def replaying(model: torch.nn.Module, routes: torch.Tensor | None):
    """Within: the routers of `model` (one model chunk) replay `routes` ([router tokens, num_layers,
    topk]); None routes every token as the router decides. A no-op for models without replay."""
    replays = attached(model, _REPLAYS)
    if not replays:
        yield
        return
    for r in replays:
        r.set_target(None if routes is None else routes[:, r.layer, :])
    try:
        yield
    finally:
        for r in replays:
            r.target = None


def has_replay(model: torch.nn.Module) -> bool:
    return bool(attached(model, _REPLAYS))


# --- routes of a micro-batch --------------------------------------------------------------------


def micro_batch_routes(micro_batch: dict, routes: Sequence[torch.Tensor | None], lengths: Sequence[int],
                       num_layers: int, topk: int) -> torch.Tensor:
    """[router tokens, num_layers, topk] for one micro-batch of `megarl.engine.micro_batches`.

    routes[r] / lengths[r]: the recorded routes and the token count of the batch row r that
    micro_batch["rows"] names (None rows are fillers of `lengths`' filler length, absent routes
    are -1). Megatron's router sees hidden states [s, b, h] flattened s-major: token t of row i
    is router token t * b + i; a packed micro-batch is one row with its sequences end to end.
    """
    ids = micro_batch["input_ids"]
    b, s = ids.shape
    out = torch.full((s, b, num_layers, topk), -1, dtype=torch.int16)
    packed = micro_batch.get("packed_seq_params") is not None
    offset = 0
    for i, (row, n) in enumerate(zip(micro_batch["rows"], lengths)):
        rec = routes[row] if row is not None else None
        if rec is not None:
            if rec.shape[1:] != (num_layers, topk):
                raise ValueError(f"routing replay: recorded routes have {tuple(rec.shape[1:])} layers x experts per token, "
                                 f"the model has {num_layers} layers x top-{topk}")
            rec = rec[:n]
            if packed:
                out[offset:offset + len(rec), 0] = rec
            else:
                out[:len(rec), i] = rec
        offset += n
    return out.reshape(s * b, num_layers, topk)


def sequence_parallel_shard(routes: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The routes of one TP rank's tokens under sequence parallelism: its routers see the s/tp
    slice [rank * s/tp, (rank + 1) * s/tp) of the sequence dimension of [s, b, h], flattened
    s-major, i.e. the rank-th of `size` equal contiguous blocks of the [s * b, ...] routes."""
    if routes.shape[0] % size:
        raise ValueError(f"routing replay: {routes.shape[0]} router tokens do not split over {size} sequence-parallel ranks")
    return routes.chunk(size)[rank]


def attach_routes(micro_batches: list[dict], routes: Sequence[torch.Tensor | None], row_lengths: Sequence[int],
                  filler_length: int, num_layers: int, topk: int, sp_shard: tuple[int, int] | None = None) -> None:
    """Add each micro-batch's routes (field ROUTES) from the batch's per-row routes. sp_shard:
    (tp rank, tp) under sequence parallelism, where each rank routes its own slice of the tokens."""
    for mb in micro_batches:
        lengths = [row_lengths[r] if r is not None else filler_length for r in mb["rows"]]
        mine = micro_batch_routes(mb, routes, lengths, num_layers, topk)
        if sp_shard is not None:
            mine = sequence_parallel_shard(mine, *sp_shard)
        mb[ROUTES] = mine.to(mb["input_ids"].device)
