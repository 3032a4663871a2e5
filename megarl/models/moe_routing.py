"""MoE routing for RL: the router's settings (fp32 logits, frozen weights, auxiliary loss) and
**routing replay**.

Routing replay (slime's `--use-routing-replay`, verl's "R3"): the rollout engine records which
experts every token was routed to in every MoE layer (`RolloutResult.routed_experts`), and the
actor's forward passes (old log-probs and the update) use those experts instead of their own top-k.
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

import re
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

LoadBalancingType = Literal["aux_loss", "seq_aux_loss", "global_aux_loss"]
ROUTES = "routes"  # micro-batch field: [router tokens, num_layers, topk] int, -1 = not recorded
_REPLAYS = "_megarl_route_replays"  # attribute of a model chunk: its routers' _LayerReplay objects
_METER = "_megarl_aux_loss_meter"


@dataclass(frozen=True)
class RouterOptions:
    """How one engine's MoE routers train.

    freeze: router weights get requires_grad=False, so DDP and the optimizer leave them out.
    aux_loss_coeff: the auxiliary load-balancing loss (0 = off, the RL default: it is a
        pre-training device, and it makes the loss depend on how tokens are split over ranks).
    load_balancing_type: Megatron's kind of auxiliary loss when the coefficient is > 0.
    replay: install routing replay on this engine's routers (the actor's).
    """

    freeze: bool = False
    aux_loss_coeff: float = 0.0
    load_balancing_type: LoadBalancingType = "aux_loss"
    replay: bool = False

    @property
    def aux_loss_on(self) -> bool:
        return self.aux_loss_coeff > 0


def router_config(options: RouterOptions | None) -> dict:
    """The router part of a MoE model's TransformerConfig.

    Router logits are computed in fp32 in every dtype: Megatron's gating linear upcasts the input
    and the (params_dtype) weight to `moe_router_dtype` before the matmul, and softmax / sigmoid and
    top-k then run in fp32. In float32 this changes nothing; in bf16 it keeps near-tied experts
    from swapping on rounding alone (transformers computes bf16 logits there, which is one reason
    routes can differ between an hf rollout and the actor, and why replay exists).
    """
    options = options or RouterOptions()
    return dict(
        moe_router_dtype="fp32",
        moe_router_load_balancing_type=options.load_balancing_type if options.aux_loss_on else "none",
        moe_aux_loss_coeff=options.aux_loss_coeff,
    )


def routers(model: torch.nn.Module) -> list:
    """Megatron's TopKRouter modules in `model` (any wrapper), in module order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def prepare(model: torch.nn.Module, options: RouterOptions | None) -> None:
    """Apply `options` to a freshly built model chunk (before DDP wraps it): freeze the routers,
    install routing replay, count auxiliary-loss forwards."""
    if options is None:
        return
    found = routers(model)
    if options.freeze:
        for router in found:
            for p in router.parameters(recurse=False):  # weight (and bias); expert_bias is a buffer
                p.requires_grad_(False)
    if options.replay:
        setattr(model, _REPLAYS, [_LayerReplay(router) for router in found])
    if options.aux_loss_on:
        setattr(model, _METER, _AuxLossMeter(found))


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
    replays = _find(model, _REPLAYS)
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


def _find(model: torch.nn.Module, name: str):
    while True:
        found = getattr(model, name, None)
        if found is not None or not hasattr(model, "module"):
            return found
        model = model.module


def has_replay(model: torch.nn.Module) -> bool:
    return bool(_find(model, _REPLAYS))


# --- transformers' group-limited top-k ----------------------------------------------------------


def hf_group_limited_topk(scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int,
                          group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k as DeepSeek-V3 and GLM-4.5 define it in transformers: a group's score is
    the sum of its two best experts' scores. Megatron-Core sums the best
    `topk // group_topk` instead, which is the same only when that is 2 (DeepSeek-V3's 8 / 4);
    a checkpoint with, say, 4 experts from 1 of 2 groups would route differently."""
    grouped = scores.view(num_tokens, num_groups, -1)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape(num_tokens, -1)
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def use_hf_group_limited_topk() -> None:
    """Make Megatron-Core's routers rank expert groups as transformers does (`hf_group_limited_topk`).

    Process-wide: `topk_routing_with_score_function` looks `group_limited_topk` up in its module at
    every call (0.16 to 0.19), so replacing it there reaches every router, replayed ones included
    (replay falls back to it for unrecorded tokens). megarl only builds models from Hugging Face
    checkpoints, whose routing transformers defines, so no router of the process wants the other rule."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.group_limited_topk = hf_group_limited_topk


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


# --- recording on the transformers side -----------------------------------------------------------

_HF_LAYER = re.compile(r"\blayers\.(\d+)\.")


def hf_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of a transformers MoE model. Every MoE family in transformers 5
    (Qwen3MoeTopKRouter, MixtralTopKRouter, DeepseekV3TopkRouter, Glm4MoeTopkRouter) returns
    (logits, weights, top-k indices) from a module whose class name ends in TopKRouter."""
    found = []
    for name, module in model.named_modules():
        m = _HF_LAYER.search(name)
        if m and type(module).__name__.lower().endswith("topkrouter"):
            found.append((int(m.group(1)), module))
    return found


class HFRouteRecorder:
    """Records the experts a transformers model routes each token to, one forward call at a time.

    `calls[c][layer]` holds call c's indices [batch * seq, topk] (transformers flattens [b, s]
    b-major). Used as a context manager around one batched decode.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = hf_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay: {type(model).__name__} has no MoE router to record (a dense model?)")
        self.num_layers = int(model.config.num_hidden_layers)
        self.calls: list[dict[int, torch.Tensor]] = []
        self._handles = []

    def __enter__(self):
        self.calls = []
        for layer, module in self.routers:
            self._handles.append(module.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, args, output):
            if layer == self.routers[0][0]:  # the first MoE layer opens a new forward call
                self.calls.append({})
            self.calls[-1][layer] = output[2].detach().to("cpu", torch.int16)
        return hook

    def routes(self, row: int, batch: int, prompt_len: int, padded_prompt_len: int, fed_responses: int) -> torch.Tensor:
        """[prompt_len + fed_responses, num_layers, topk] of one row of a left-padded batch: call 0
        is the prompt forward ([batch, padded_prompt_len]), each later call one decoded token."""
        topk = next(iter(self.calls[0].values())).shape[-1]
        out = torch.full((prompt_len + fed_responses, self.num_layers, topk), -1, dtype=torch.int16)
        for layer, idx in self.calls[0].items():
            out[:prompt_len, layer] = idx.view(batch, padded_prompt_len, topk)[row, padded_prompt_len - prompt_len:]
        for j in range(fed_responses):
            for layer, idx in self.calls[1 + j].items():
                out[prompt_len + j, layer] = idx.view(batch, topk)[row]
        return out


# --- auxiliary load-balancing loss as a metric ----------------------------------------------------


class _AuxLossMeter:
    """Counts the training forwards of each router, so the tracker's sums become means."""

    def __init__(self, found: list):
        self.counts: dict[int, int] = {}
        for router in found:
            router.register_forward_hook(self._hook(router))

    def _hook(self, router):
        def hook(module, args, output):
            if module.training and torch.is_grad_enabled():
                layer = router.layer_number - 1
                self.counts[layer] = self.counts.get(layer, 0) + 1
        return hook


def aux_loss_metric(chunks: Sequence[torch.nn.Module], dims) -> float | None:
    """The auxiliary load-balancing loss (without its coefficient) averaged over MoE layers, training
    forwards and data-parallel ranks since the last call; None when the loss is off. `chunks`: this
    rank's model chunks (one per virtual pipeline stage). Collective over the pipeline and
    data-parallel groups. Reads and clears Megatron's aux-loss tracker."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from megarl.parallel import all_reduce_host

    meters = [m for m in (_find(c, _METER) for c in chunks) if m is not None]
    if not meters:
        return None
    num_layers = unwrap_config(chunks[0]).num_layers
    sums = torch.zeros(num_layers, dtype=torch.float64)
    counts = torch.zeros(num_layers, dtype=torch.float64)
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        if name.endswith("load_balancing_loss"):
            sums += entry["values"].detach().double().cpu()[:num_layers]
    for meter in meters:  # each chunk counts the forwards of its own layers
        for layer, n in meter.counts.items():
            counts[layer] += n
        meter.counts.clear()
    clear_aux_losses_tracker()
    both = torch.stack([sums, counts])
    if dims.pp > 1:
        both = all_reduce_host(both, dims.pp_group)
    if dims.dp > 1:
        both = all_reduce_host(both, dims.dp_group) / dims.dp
    sums, counts = both
    layers = counts > 0
    return float((sums[layers] / counts[layers]).mean()) if layers.any() else 0.0


def unwrap_config(model: torch.nn.Module):
    while hasattr(model, "module"):
        model = model.module
    return model.config


def check_routing_options(options: RouterOptions, is_moe: bool, family: str) -> None:
    """A dense model with MoE-only options is a config mistake, said once."""
    if is_moe:
        return
    for key, on in (("actor.routing_replay", options.replay), ("actor.moe_aux_loss_coeff", options.aux_loss_on)):
        if on:
            raise ValueError(f"{key} applies to mixture-of-experts models; model.path is a dense {family} model: "
                             f"turn it off")


__all__ = ["RouterOptions", "router_config", "prepare", "replaying", "has_replay", "attach_routes",
           "micro_batch_routes", "sequence_parallel_shard", "use_hf_group_limited_topk", "HFRouteRecorder", "hf_routers", "aux_loss_metric", "ROUTES"]
