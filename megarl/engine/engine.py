"""MegatronEngine: one role's model, DDP wrapper, distributed optimizer and pipeline schedules.

The actor (policy loss), critic (value loss) and reference (forward only) are all this class,
configured differently; the trainer composes them. Loss normalisation is global: the loss function
receives the totals of the whole mini-batch (all micro-batches, all DP ranks) and returns its
micro-batch's *contribution*, so summing gradients over micro-batches and DP ranks gives exactly
the gradient of the one-batch loss, whatever the split (see `megarl.algorithms.agg_loss`).
It is long because `MegatronEngine` is one object over state its methods share (the model chunks,
DDP buffers, optimizer and scheduler): building, forward, train step, LR scaling, offload and
checkpoint calls; what needs none of that state already lives beside it (forward.py,
micro_batches.py, offload.py, checkpointing.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from megarl.engine import context_parallel, micro_batches, offload, solo_groups
from megarl.engine.batch import LossBatch, LossFn, ModelOutputs, SequenceBatch, Totals
from megarl.engine.checkpointing import load_engine, save_engine
from megarl.engine.forward import interleaved_count, is_dense, model_forward, pipeline_forward, schedule_inputs
from megarl.models import load_model_chunks, lora, moe_routing
from megarl.models.lora import LoraOptions
from megarl.models.moe_routing import RouterOptions
from megarl.models.sequence_parallel import sequence_multiple
from megarl.models.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs
from megarl.models.weights import export_hf, local_weight_shards, save_hf_checkpoint, unwrap
from megarl.distributed.parallel import ParallelDims, all_reduce_host, broadcast_host
from megarl.platform import host_allocator
from megarl.platform.cpu_compat import backward_without_device_rewrite, device_rewrite_paused


@dataclass
class OptimConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    min_lr: float = 0.0
    total_steps: int = 1000  # optimizer steps, for the cosine schedule


@dataclass
class EngineConfig:
    dtype: str = "float32"
    optim: OptimConfig = field(default_factory=OptimConfig)
    max_tokens_per_microbatch: int = 4096  # per DP rank; padded tokens count
    sequence_packing: bool = True  # one row of end-to-end sequences per micro-batch (no padding)
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    recompute: str = "none"  # none | selective (core attention) | full (every layer)
    routing: RouterOptions | None = None  # MoE routers: freeze, auxiliary loss, routing replay
    lora: LoraOptions | None = None  # low-rank adapters (megarl.models.lora); None or rank 0: every weight trains
    # value_head: False keeps the scalar head's bias fixed. A reward model's Bradley-Terry gradient of it
    # is 0 up to rounding, which Adam would still turn into steps; transformers' *ForSequenceClassification
    # head has no bias, so a drifted one would shift every score of the export.
    train_value_head_bias: bool = True


def fused_adam_on_cpu(optimizer) -> None:
    """torch's fused Adam for Megatron's CPU fallback optimizer.

    Without Transformer-Engine or Apex, Megatron-Core builds `torch.optim.AdamW` and leaves
    `foreach`/`fused` unset, which on CPU tensors means the per-tensor loop (`_single_tensor_adam`):
    a dozen kernel launches per parameter. The fused CPU kernel does one pass per parameter (3x
    faster on the demo's parameters). It is elementwise, so every layout (any TP/DP sharding of the
    same parameters) still gets bitwise the same update as every other; it rounds differently from
    the per-tensor loop in the last bit, so runs are not bitwise those of earlier megarl versions.
    On GPU nothing changes (Megatron's fused Adam, or torch's own default)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if group["params"] and all(p.device.type == "cpu" for p in group["params"]) and not group.get("differentiable"):
                group["foreach"], group["fused"] = False, True


def wrap_for_training(chunks: list, cfg: EngineConfig) -> tuple[list, object]:
    """Megatron's DDP around each model chunk and the distributed optimizer over them: what a
    trainable engine trains with (the dry run, megarl.tools.dryrun, builds the same on the meta device)."""
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    solo_groups.install()  # no collective over a group of one (DDP buffers, optimizer, grad norm)
    o = cfg.optim
    bf16 = cfg.dtype == "bfloat16"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True, bucket_size=None
    )
    # Megatron-LM's rule: only the first chunk's DDP buckets gradients (bucketing the others would
    # start their reductions out of order under interleaving).
    chunks = [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
              for i, m in enumerate(chunks)]
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_eps=o.eps,
        clip_grad=o.max_grad_norm,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=True,  # ZeRO-1: optimizer state sharded over DP
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    fused_adam_on_cpu(optimizer)
    return chunks, optimizer


def _weighted(value, weight: float):
    """A micro-batch's metric times its token weight, in float64 (a tensor stays on its device:
    float64 products and sums, the arithmetic of Python floats, so the result is the same either way)."""
    if isinstance(value, torch.Tensor):
        return value.detach().double() * weight
    return value * weight


@dataclass
class TrainStats:
    grad_norms: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # MoE: the auxiliary load-balancing loss (without its coefficient) averaged over MoE layers,
    # forwards and DP ranks since the last train_step (megarl.models.moe_routing); None when off
    moe_aux_loss: float | None = None


class MegatronEngine:
    """One model role on this rank: `value_head=True` for a value model (the critic, a reward model),
    `trainable=False` for the reference."""

    def __init__(self, model_dir: str, dims: ParallelDims, cfg: EngineConfig, *, value_head: bool = False, trainable: bool = True,
                 seed: int = 0, meta: bool = False):
        """meta=True: shapes only, on the meta device, no weights read (the dry run, megarl.tools.dryrun;
        construct it under megarl.platform.fake_world.MetaAllocation)."""
        self.dims, self.cfg, self.value_head, self.trainable, self.seed = dims, cfg, value_head, trainable, seed
        # One model chunk per virtual pipeline stage (dims.vpp), else one: Megatron's schedules, DDP
        # and optimizer take the list; `self.chunks` holds them (DDP-wrapped when trainable).
        self.chunks, self.spec = load_model_chunks(model_dir, dims, dtype=cfg.dtype, critic=value_head, recompute=cfg.recompute,
                                                   routing=cfg.routing, meta=meta)
        self.model_dir = model_dir
        self.lora = cfg.lora if cfg.lora is not None and cfg.lora.enabled else None
        if self.lora is not None:  # before DDP: frozen base weights get no grad buffer, no optimizer state
            lora.apply(self.chunks, self.spec, dims, self.lora)
        self.optimizer = self.scheduler = None
        self.optimizer_steps = 0
        if value_head and not cfg.train_value_head_bias:  # before DDP: no grad buffer, no optimizer state
            for m in self.modules:
                if m.post_process:
                    m.output_layer.bias.requires_grad_(False)
        if trainable:
            self._wrap_for_training()
        else:
            for m in self.modules:
                for p in m.parameters():
                    p.requires_grad_(False)
        self._set_mode(train=False)
        self._offloaded: dict[str, bool] = {}
        self.bytes_moved = {"offload": 0, "onload": 0}  # cumulative, for per-step reporting

    # --- setup -------------------------------------------------------------------------------------
    def _wrap_for_training(self) -> None:
        # deferred: megatron (seconds to import) loads only when this runs
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if self.device.type == "cpu":  # each step's activations reuse freed memory: no fresh pages to fault in
            host_allocator.keep_freed_memory()
        self.chunks, self.optimizer = wrap_for_training(self.chunks, self.cfg)
        o = self.cfg.optim
        decay_steps = max(o.total_steps, o.warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if o.warmup_steps else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=o.schedule,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
        )

    @property
    def model(self) -> torch.nn.Module:
        """The (DDP-wrapped) model of a rank that holds one chunk; with virtual pipeline stages, `chunks`."""
        if len(self.chunks) != 1:
            raise RuntimeError(f"this rank holds {len(self.chunks)} model chunks (parallel.vpp): use engine.chunks")
        return self.chunks[0]

    @property
    def modules(self) -> list[torch.nn.Module]:
        """This rank's model chunks, unwrapped (one per virtual pipeline stage)."""
        return [unwrap(m) for m in self.chunks]

    @property
    def module(self) -> torch.nn.Module:
        """The first (often only) chunk: its config is every chunk's."""
        return unwrap(self.chunks[0])

    def _set_mode(self, train: bool) -> None:
        for m in self.modules:
            m.train(train)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype the weights are kept in (model.dtype): the rollout engine is built in it."""
        return self.module.config.params_dtype

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate by factor from now on. The scheduler recomputes each group's
        lr from its max_lr / min_lr at every optimizer step, so those are scaled too."""
        for group in self.optimizer.param_groups:
            group["max_lr"] = group.get("max_lr", group["lr"]) * factor
            group["min_lr"] = group.get("min_lr", 0.0) * factor
            group["lr"] *= factor

    # --- micro-batching (megarl.engine.micro_batches) ------------------------------------------------
    def _micro_batches(self, batch: SequenceBatch, rows: list[int], fields: tuple[str, ...] = ()) -> list[dict]:
        cp = self.dims.cp
        lengths = [context_parallel.padded_length(len(batch.input_ids[r]), cp) for r in rows]
        budget = self.cfg.max_tokens_per_microbatch  # the CP group's tokens: 1/cp of them on each rank
        if self.cfg.sequence_packing:
            # Row lengths divisible by tp keep sequence-parallel splits even; by 8, tensor-core shapes
            # (and by 2*cp*tp under context parallelism: megarl.engine.context_parallel).
            plan = micro_batches.plan_packed(lengths, budget, self._agree_max, multiple=context_parallel.width_multiple(self.dims.tp, cp))
            plan.seq_multiple = 2 * cp if cp > 1 else 1
        elif cp > 1:
            raise ValueError("context parallelism needs packed micro-batches: set model.sequence_packing=true")
        else:
            plan = micro_batches.plan_padded(lengths, budget, self._agree_max, multiple=sequence_multiple(self.dims))
        # Interleaved schedules need a multiple of pp micro-batches: filler ones carry no rows.
        filler = [None] * (1 if plan.packed else len(plan.bins[0]))
        plan.bins += [list(filler) for _ in range(interleaved_count(len(plan.bins), self.dims) - len(plan.bins))]
        with device_rewrite_paused():  # megarl's own tensors: no CUDA device named (cpu_compat)
            built = micro_batches.build(plan, batch, rows, fields, self.device)
        sp_shard = (self.dims.tp_rank, self.dims.tp) if self.dims.sequence_parallel else None
        if batch.routes is not None and any(moe_routing.has_replay(c) for c in self.chunks):  # the rollout's experts
            moe_routing.attach_routes(built, batch.routes, [context_parallel.padded_length(len(s), cp) for s in batch.input_ids],
                                      context_parallel.padded_length(len(micro_batches.FILLER), cp), self.spec.num_layers, self.spec.moe_topk,
                                      sp_shard=sp_shard if cp == 1 else None)
        if cp > 1:  # the routes' SP shard is taken after the CP split: SP splits this rank's tokens
            for mb in built:
                context_parallel.shard(mb, cp, self.dims.cp_rank, sp_shard)
            context_parallel.check_same_batches(built, self.dims.cp_group)
        return built

    def _agree_max(self, values: list[int]) -> list[int]:
        return self._over_dp(torch.tensor(values, dtype=torch.long), dist.ReduceOp.MAX).tolist()

    def _over_dp(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """A small host tensor reduced over the data-parallel group."""
        return all_reduce_host(t, self.dims.dp_group, op=op) if self.dims.dp > 1 else t

    def _outputs(self, model_output: torch.Tensor, mb: dict, entropy: bool, temperature: float,
                 banned_token_ids: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Per-response-token outputs [rows, response_len] from the last stage's model output
        ([b, s, ...]; `positions` index its flattened b*s positions). Log-probs and entropy are those
        of the sampling distribution: logits / temperature over the vocabulary without the banned ids."""
        pos = mb["positions"].to(model_output.device)
        flat = model_output.reshape(-1, model_output.shape[-1])  # [b*s, vocab/tp] or [b*s, 1]
        if self.dims.cp > 1:
            # This CP rank's share of the response positions; spread() sums the shares over CP.
            owned, sel, targets = context_parallel.select(mb, pos)
            cp_group = self.dims.cp_group

            def spread(x):
                return context_parallel.spread(x, owned, cp_group)
        else:
            sel, targets = pos, mb["input_ids"].reshape(-1)[pos + 1]  # position t predicts token t+1

            def spread(x):
                return x
        if self.value_head:
            return {"values": spread(flat[:, 0].float()[sel])}
        # Select the response positions before the vocab-parallel math: prompts cost nothing more.
        resp_logits = flat[sel]  # [rows, R, vocab/tp] ([owned, vocab/tp] under CP)
        if temperature != 1.0:
            resp_logits = resp_logits / temperature
        tp_group = self.dims.tp_group if self.dims.tp > 1 else None
        vocab = {"true_vocab_size": self.spec.vocab_size, "banned_token_ids": banned_token_ids}
        logprobs = spread(vocab_parallel_logprobs(resp_logits, targets, tp_group, **vocab))
        # Masked slots (past a response's end, filler rows of pad tokens) may target a banned token,
        # whose log-prob is about -3e38: zero them so no loss term (a squared log-ratio) overflows.
        out = {"logprobs": torch.where(mb["response_mask"].to(logprobs.device) > 0, logprobs, 0.0)}
        if entropy:
            out["entropy"] = spread(vocab_parallel_entropy(resp_logits, tp_group, **vocab))
        return out

    # --- forward only ---------------------------------------------------------------------------------
    def forward_only(self, batch: SequenceBatch, entropy: bool = False, temperature: float = 1.0,
                     banned_token_ids: tuple[int, ...] = (), adapters: bool = True) -> ModelOutputs:
        """Per-response-token log-probs (and the entropy, if `entropy`) or values, [n, response_len], on every rank.
        temperature and banned_token_ids: the rollout's, so the log-probs are of the distribution it sampled.
        adapters=False: the base model under LoRA (the reference policy without a second model)."""
        if adapters or self.lora is None:
            return self._forward_only(batch, entropy, temperature, banned_token_ids)
        with lora.disabled(self.chunks):
            return self._forward_only(batch, entropy, temperature, banned_token_ids)

    def _forward_only(self, batch, entropy, temperature, banned_token_ids) -> ModelOutputs:
        self.onload()
        self._set_mode(train=False)
        rows = list(range(len(batch)))
        micro_batches = self._micro_batches(batch, rows)

        def compute(output, mb):
            return {k: v.detach().float().cpu() for k, v in self._outputs(output, mb, entropy, temperature, banned_token_ids).items()}

        results = pipeline_forward(self.chunks, self.dims, micro_batches, compute)
        merged = {k: torch.zeros(len(batch), batch.response_len) for k in results[0]}
        for mb, result in zip(micro_batches, results):
            slots = [i for i, r in enumerate(mb["rows"]) if r is not None]  # filler rows carry nothing
            targets = [mb["rows"][i] for i in slots]
            for k, v in result.items():
                merged[k][targets] = v[slots]
        return ModelOutputs(**{k: v * batch.response_mask.to(v.dtype) for k, v in merged.items()})

    # --- training ---------------------------------------------------------------------------------------
    def train_step(
        self,
        batch: SequenceBatch,
        loss_fn: LossFn,
        *,
        fields: tuple[str, ...],
        epochs: int = 1,
        mini_batches: int = 1,
        num_global: int | None = None,
        shuffle_seed: int = 0,
        entropy: bool = False,
        temperature: float = 1.0,
        banned_token_ids: tuple[int, ...] = (),
        skip_grad_norm_above: float | None = None,
    ) -> TrainStats:
        """`epochs` x `mini_batches` optimizer steps over the global batch.

        Mini-batches are drawn from one permutation of the *global* sample indices per epoch, so
        every layout forms the same mini-batches; each rank trains on its own rows of them.
        A step whose gradient norm is not finite or exceeds `skip_grad_norm_above` is skipped.
        temperature and banned_token_ids define the policy's distribution, as in forward_only;
        entropy: the loss's outputs carry the entropy too. The MoE auxiliary loss of the step's
        forwards is in the returned stats (collective over PP and DP when it is on).
        """
        # deferred: megatron (seconds to import) loads only when this runs
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not self.trainable:
            raise RuntimeError("train_step on a frozen (reference) engine")
        self.onload()
        self._set_mode(train=True)
        num_global = num_global or self._global_count(len(batch))
        if num_global % mini_batches:
            raise ValueError(f"{num_global} sequences per step are not divisible into {mini_batches} mini-batches")
        position = {g: i for i, g in enumerate(batch.global_index)}
        stats = TrainStats()
        metric_sums: dict[str, float | torch.Tensor] = {}
        metric_weight = 0.0
        # DDP averages gradients over the data-parallel x context-parallel ranks (Megatron's dp_cp group).
        grad_avg_ranks = self.dims.dp * self.dims.cp
        dense = is_dense(self.chunks)  # on CPU: forward, loss and backward without the device-rewrite mode
        for epoch in range(epochs):
            perm = torch.randperm(num_global, generator=torch.Generator().manual_seed(shuffle_seed * 1000 + epoch)).tolist()
            size = num_global // mini_batches
            for k in range(mini_batches):
                rows = [position[g] for g in perm[k * size : (k + 1) * size] if g in position]
                micro_batches = self._micro_batches(batch, rows, fields)
                totals = self._totals(batch, rows)
                num_mb = len(micro_batches)
                reduced: list[dict] = []

                def loss_func(mb, output):
                    with device_rewrite_paused(dense):  # megarl's own code: it names no CUDA device
                        outputs = self._outputs(output, mb, entropy, temperature, banned_token_ids)
                        loss, metrics = loss_fn(ModelOutputs(**outputs), LossBatch(mb["response_mask"], mb["response_tokens"],
                                                                                   {f: mb[f] for f in fields}), totals)
                    weight = mb["response_tokens"]  # counted on the host when the micro-batch was built
                    reduced.append({"weight": weight, **{m: _weighted(v, weight) for m, v in metrics.items()}})
                    # The schedule divides by the micro-batch count and DDP averages over DP; both
                    # are undone so that contributions are *summed* (see module docstring).
                    return loss * (num_mb * grad_avg_ranks), torch.tensor(1, dtype=torch.int), {}

                def forward_step(data_iterator, model):
                    mb = next(data_iterator)
                    return model_forward(model, mb), partial(loss_func, mb)

                for chunk in self.chunks:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                # the global width: Megatron divides it by cp for the pipeline's activation shapes
                seq_len = micro_batches[0].get("cp_width", micro_batches[0]["input_ids"].shape[1])
                chunks, data_iterator = schedule_inputs(self.chunks, micro_batches, self.dims)
                with backward_without_device_rewrite(dense):
                    get_forward_backward_func()(
                        forward_step_func=forward_step,
                        data_iterator=data_iterator,
                        model=chunks,
                        num_microbatches=num_mb,
                        seq_length=seq_len,
                        micro_batch_size=micro_batches[0]["input_ids"].shape[0],
                        forward_only=False,
                    )
                grad_norm = self._optimizer_step(skip_grad_norm_above, stats)
                stats.grad_norms.append(grad_norm)
                for entry in reduced:
                    metric_weight += entry.pop("weight")
                    for m, v in entry.items():
                        metric_sums[m] = metric_sums.get(m, 0.0) + v
        stats.metrics = self._reduce_metrics(metric_sums, metric_weight)
        # every forward since the last read: this step's and the forward_only calls before it
        stats.moe_aux_loss = moe_routing.aux_loss_metric(self.chunks, self.dims)
        return stats

    def _optimizer_step(self, skip_above: float | None, stats: TrainStats) -> float:
        # prepare_grads (grad copy; the found-inf collective only with a loss scaler, i.e. not in
        # float32/bf16) and the global norm (one collective) run once. optimizer.step() would
        # redo both before clipping with the very same norm.
        found_inf = self.optimizer.prepare_grads()
        norm = None if found_inf else self.optimizer.get_grad_norm()
        grad_norm = float("nan") if norm is None else float(norm)
        if not math.isfinite(grad_norm) or (skip_above is not None and grad_norm > skip_above):
            stats.skipped_steps += 1
            self.optimizer.zero_grad()
            return grad_norm
        # Clipping (megarl's CPU version on CPU), Adam and the parameter copies name no CUDA device:
        # on CPU they run without the device-rewrite mode (megarl.platform.cpu_compat).
        with device_rewrite_paused():
            self._clip_to(norm)
            self.optimizer.step_with_ready_grads()  # Adam (and the distributed optimizer's all-gather)
        self.scheduler.step(increment=1)
        self.optimizer_steps += 1
        return grad_norm

    def _clip_to(self, total_norm) -> None:
        """Scale the main grads to max_grad_norm given their global norm, as optimizer.step() does."""
        # deferred: megatron (seconds to import) loads only when this runs
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if getattr(optimizer, "is_stub_optimizer", False) or optimizer.config.clip_grad <= 0.0:
                continue
            parameters = optimizer.get_parameters()
            if parameters:
                clip_grad_by_total_norm_fp32(parameters, max_norm=optimizer.config.clip_grad, total_norm=total_norm,
                                             use_decoupled_grad=optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    def _global_count(self, local: int) -> int:
        return int(self._over_dp(torch.tensor([local], dtype=torch.long)))

    def _totals(self, batch: SequenceBatch, rows: list[int]) -> Totals:
        """Valid tokens and non-empty sequences in the whole mini-batch (summed over DP)."""
        mask = batch.response_mask[rows] if rows else batch.response_mask[:0]
        t = self._over_dp(torch.tensor([mask.sum().item(), (mask.sum(-1) > 0).sum().item()], dtype=torch.float64))
        return Totals(tokens=float(t[0]), seqs=float(t[1]))

    def _reduce_metrics(self, sums: dict[str, float | torch.Tensor], weight: float) -> dict[str, float]:
        """Token-weighted means over micro-batches and DP ranks, then from the last stage to all.
        The step's one read of the loss's tensor metrics (one device-to-host copy)."""
        keys = sorted(sums)
        t = torch.tensor([weight] + [0.0] * len(keys), dtype=torch.float64)
        if keys:
            values = [sums[k] for k in keys]
            device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
            t[1:] = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values]).cpu()
        box = [keys]
        if self.dims.pp > 1:
            src = self.dims.pp_stage_ranks()[-1]
            dist.broadcast_object_list(box, src=src, group=self.dims.pp_group)
            keys = box[0]
            if not self.dims.is_last_stage:
                t = torch.zeros(1 + len(keys), dtype=torch.float64)
            t = broadcast_host(t, src, self.dims.pp_group)
        t = self._over_dp(t)
        total = max(float(t[0]), 1e-12)
        return {k: float(v) / total for k, v in zip(keys, t[1:])}

    # --- weights out --------------------------------------------------------------------------------------
    def export_hf(self):
        self.onload()
        # Under LoRA: the merged model (W + scale * B @ A, merged in float32)
        overrides = lora.merged_weights(self.chunks, self.spec, self.dims) if self.lora else None
        return export_hf(self.chunks, self.spec, self.dims, critic=self.value_head, overrides=overrides)

    def local_weight_shards(self):
        """This rank's parameters for the weight sync; only they come back from the host (the
        gradients and optimizer state stay there: the sync only reads the parameters)."""
        self.onload(parts=("params",))
        shards = local_weight_shards(self.chunks, self.spec, self.dims)
        return lora.merged_shards(self.chunks, self.spec, self.dims, shards) if self.lora else shards

    def base_weight_shards(self):
        """As local_weight_shards, without merging the adapters: the frozen base under LoRA
        (megarl.hybrid.lora_sync sends it once; the engine applies the adapters itself)."""
        self.onload(parts=("params",))
        return local_weight_shards(self.chunks, self.spec, self.dims)

    def full_adapters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The whole LoRA adapters on every rank, by HF module name: (A, B) (collective over the world)."""
        self.onload(parts=("params",))
        return lora.full_adapters(self.chunks, self.spec, self.dims)

    def save_peft_adapter(self, out_dir, base_model: str) -> dict[str, int]:
        """This engine's LoRA adapters as a PEFT adapter directory (megarl.models.lora.save_peft_adapter)."""
        return lora.save_peft_adapter(self.chunks, self.spec, self.dims, self.lora, out_dir, base_model)

    def save_hf_checkpoint(self, out_dir, source_dir, banned_token_ids=()) -> None:
        """An HF model directory of this engine's weights (under LoRA the merged model, W + scale *
        B @ A merged in float32); collective, rank 0 writes (megarl.models.weights.save_hf_checkpoint)."""
        overrides = lora.merged_weights(self.chunks, self.spec, self.dims) if self.lora else None
        save_hf_checkpoint(self.chunks, self.spec, self.dims, out_dir, source_dir, critic=self.value_head,
                           banned_token_ids=banned_token_ids, overrides=overrides)

    # --- offload ----------------------------------------------------------------------------------------------
    def offload(self) -> dict[str, int]:
        """Move what the config says (params, grads, optimizer state) to host memory; returns bytes moved."""
        wanted = {"params": self.cfg.param_offload, "grads": self.cfg.grad_offload and self.trainable,
                  "optimizer": self.cfg.optimizer_offload and self.trainable}
        parts = tuple(part for part, on in wanted.items() if on and not self._offloaded.get(part))
        moved = offload.offload_parts(self, parts) if parts else {}  # one wait for all of them
        self._offloaded.update({part: True for part in parts})
        self.bytes_moved["offload"] += sum(moved.values())
        return moved

    def onload(self, parts: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict[str, int]:
        """Bring `parts` of what offload() moved back to the device; returns bytes moved."""
        back = tuple(part for part in ("params", "grads", "optimizer") if part in parts and self._offloaded.pop(part, False))
        moved = offload.onload_parts(self, back)
        self.bytes_moved["onload"] += sum(moved.values())
        return moved

    def resident_bytes(self) -> dict[str, int]:
        """Parameters, gradients and optimizer state now in memory, in bytes (0 while offloaded)."""
        return offload.resident_bytes(self)

    def state_bytes(self) -> dict[str, int]:
        """This rank's parameters (all, trainable), gradient buffers and optimizer state in bytes,
        by size whether offloaded or not (megarl.engine.offload.state_bytes)."""
        return offload.state_bytes(self)

    # --- checkpoint (megarl.engine.checkpointing) ------------------------------------------------------
    def save(self, path: str) -> float:
        """Distributed checkpoint of weights + optimizer (+ scheduler) into `path`; returns seconds."""
        return save_engine(self, path)

    def load(self, path: str) -> None:
        """Load a checkpoint saved by `save` under any parallel layout."""
        load_engine(self, path)
        if self.optimizer is not None:
            fused_adam_on_cpu(self.optimizer)  # loaded param groups carry the saving run's choice

    def extra_state(self) -> dict:
        return {"optimizer_steps": self.optimizer_steps, "scheduler": self.scheduler.state_dict() if self.scheduler else None}

    def load_extra_state(self, state: dict) -> None:
        self.optimizer_steps = state["optimizer_steps"]
        if self.scheduler and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])

