"""Per-GPU memory by phase, weight-sync bytes and a step-time estimate for one layout.

Memory follows what megarl's engine allocates (megarl/engine/engine.py, offload.py):
- each trainable engine (actor, critic) is wrapped in Megatron's DDP with the distributed
  optimizer: parameters and gradients live in one contiguous buffer per parameter group (dense,
  expert), every parameter starting 64 elements aligned and the buffer padded to a multiple of
  lcm(DP, 128) (megatron/core/distributed/param_and_grad_buffer.py); gradients are reduced in
  fp32 (`grad_reduce_in_fp32=True`); Adam's two moments (fp32), plus an fp32 master copy when the
  weights are bf16, are sharded over the data-parallel group of each parameter group (dense:
  DP x CP; experts: expert-DP = TP x DP x CP / (EP x ETP));
- the reference is frozen: parameters only, no buffer padding;
- `memory/resident_gb/<phase>` (trainer) measures exactly these three kinds, so the tests compare
  them; activations, logits and the rollout engine's memory are estimates (formulas below).
Offload (megarl's `*_offload`): what is offloaded leaves the GPU while the rollout generates and
comes back for the next forward/backward. `optimizer_offload="cpu"` is Megatron's CPU optimizer
(state on host for the step too: verl's recipes), which megarl's engine does not do yet.
It is long because it holds the planner's three estimates (memory per phase, sync bytes, step
time) and the search over layouts that compares them; the search (`search`, `balanced_split`) is
the part to move out next if it grows.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from megarl.capacity.arch import (Arch, Tensor, embedding_tensor, forward_flops_per_token, head_tensors, layer_tensors,
                              lora_tensors, params_active, params_mtp, params_total, stage_layers, train_flops_per_token)
from megarl.layout import ParallelLayout, RolloutLayout, assign_rollout, check_model, check_rollout, hybridflow_bytes_per_rank
from megarl.capacity.hardware import GPU
from megarl.layout.sync_cost import delta_wire_fraction

# The changed fraction of a delta sync the planner assumes: bf16 elements that moved per sync under
# PPO's AdamW at lr 1e-6, measured by benchmarks/delta_sync.py (results/delta_sync_cpu.json: 1.3% dense, 1.4% MoE).
DELTA_CHANGED_FRACTION = 0.013

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    ep: int = 1
    etp: int | None = None  # None = tp (Megatron's default)
    cp: int = 1
    rollout_tp: int = 1
    sequence_parallel: bool = True  # parallel.sequence_parallel (the schema's default); no effect at tp 1

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism splits the activations between the TP regions."""
        return self.sequence_parallel and self.tp > 1

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


@dataclass(frozen=True)
class RunShape:
    prompts_per_step: int = 256
    samples_per_prompt: int = 8
    prompt_len: int = 1024
    response_len: int = 4096
    max_tokens_per_microbatch: int = 8192  # per DP rank
    ppo_epochs: int = 1
    critic: bool = False  # GAE: a critic engine beside the actor
    ref: bool = True  # a KL reference engine
    recompute: str = "none"  # none | selective | full
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: str = "none"  # none | phases (megarl) | cpu (Megatron CPU optimizer)
    dtype: str = "bfloat16"
    gpu_memory_fraction: float = 0.6  # the rollout engine's share of GPU memory (vLLM gpu_memory_utilization)
    mfu: float = 0.35  # assumed for training forward/backward
    gen_mfu: float = 0.10  # assumed for generation (decode is memory-bound)
    overhead_gib: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    lora_rank: int = 0  # actor.lora.rank (and the critic's): adapters train, the base is frozen; no ref engine
    rollout_workspace_gib: float = 2.0  # the rollout engine's activations and sampler
    weight_sync: str = "full"  # rollout.weight_sync.mode: full | delta
    # delta: the share of the bf16 elements that change per sync (benchmarks/delta_sync.py at lr 1e-6)
    delta_changed_fraction: float = DELTA_CHANGED_FRACTION


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: GPU


def parallel_layout(lay: Layout, gpus: int) -> ParallelLayout:
    """The training layout of `lay` on `gpus` GPUs (megarl.layout: dp derived, degrees checked)."""
    mp = lay.tp * lay.pp * lay.cp
    if gpus % mp:
        raise ValueError(f"--gpus {gpus} is not divisible by tp {lay.tp} x pp {lay.pp} x cp {lay.cp} = {mp}")
    return ParallelLayout.for_world(gpus, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, etp=lay.etp, vpp=lay.vpp,
                                    first_stage_layers=lay.first_stage_layers, last_stage_layers=lay.last_stage_layers,
                                    sequence_parallel=lay.sequence_parallel)


def check(arch: Arch, lay: Layout, cl: Cluster) -> tuple[int, int]:
    """(dp, expert dp); ValueError with the arithmetic when the layout does not divide. The rules
    are megarl.layout's, Megatron-Core's only: a plan may show a layout megarl's trainer refuses
    (MoE at tp > 1 without sequence parallelism)."""
    par = parallel_layout(lay, cl.gpus)
    check_model(arch.shape, par)
    check_rollout("", lay.rollout_tp, cl.gpus)
    return par.dp, par.expert_dp if arch.is_moe else 1


# --- what one GPU holds ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def stage_tensors(arch: Arch, lay: Layout, stage: int, critic: bool = False) -> tuple[Tensor, ...]:
    """The Megatron tensors of one pipeline stage (full sizes; `local_numel` cuts them)."""
    stages = stage_layers(arch.num_layers, lay.pp, lay.first_stage_layers, lay.last_stage_layers)
    out: list[Tensor] = []
    if stage == 0:
        out.append(embedding_tensor(arch, lay.tp))
    for layer in stages[stage]:
        out += layer_tensors(arch, layer)
    if stage == lay.pp - 1:
        head = head_tensors(arch, lay.tp, critic)
        if arch.tie_embeddings and not critic and lay.pp == 1:
            head = head[:1]  # the embedding is the LM head
        out += head
    return tuple(out)


def local_numel(t: Tensor, lay: Layout) -> int:
    """Elements of t on one GPU (all of its local experts for an expert tensor)."""
    if t.split == "tp":
        return t.numel // lay.tp
    if t.split == "expert":
        return t.numel // lay.expert_tp * (t.count // lay.ep)
    return t.numel


def _buffer_numel(tensors: list[tuple[int, int]], dp: int) -> int:
    """Megatron DDP buffer elements for (numel, copies) params: 64-aligned starts, end padded to lcm(dp, 128)."""
    n = sum(-(-numel // 64) * 64 * copies for numel, copies in tensors)
    m = math.lcm(dp, 128)
    return -(-n // m) * m


@dataclass
class EngineState:
    params: float = 0.0  # bytes on one GPU
    grads: float = 0.0
    optimizer: float = 0.0

    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def engine_state(arch: Arch, lay: Layout, stage: int, run: RunShape, dp: int, edp: int, role: str) -> EngineState:
    """Bytes of one engine's parameters, gradients and optimizer state on a GPU of `stage`."""
    pbytes = DTYPE_BYTES[run.dtype]
    tensors = stage_tensors(arch, lay, stage, critic=(role == "critic"))
    if role == "ref":  # frozen: plain parameters
        return EngineState(params=sum(local_numel(t, lay) for t in tensors) * pbytes)
    dense_dp = dp * lay.cp
    if run.lora_rank:
        # The base is frozen: plain parameters, no gradient buffer, no optimizer state; only the
        # adapters (and a critic's value head) are in DDP's buffers and the optimizer.
        base = sum(local_numel(t, lay) for t in tensors if not t.name.startswith("value_head"))
        tensors = tuple(lora_stage_tensors(arch, lay, stage, run.lora_rank)) + tuple(t for t in tensors if t.name.startswith("value_head"))
        state = _trained_state(tensors, lay, dense_dp, edp, pbytes)
        state.params += base * pbytes
        return state
    return _trained_state(tensors, lay, dense_dp, edp, pbytes)


def lora_stage_tensors(arch: Arch, lay: Layout, stage: int, rank: int) -> list[Tensor]:
    stages = stage_layers(arch.num_layers, lay.pp, lay.first_stage_layers, lay.last_stage_layers)
    return [t for layer in stages[stage] for t in lora_tensors(arch, layer, rank)]


def _trained_state(tensors, lay: Layout, dense_dp: int, edp: int, pbytes: int) -> EngineState:
    """Parameters in DDP's buffers, fp32 gradient buffers, Adam state sharded over each group's DP."""
    dense = [t for t in tensors if t.split != "expert"]
    experts = [t for t in tensors if t.split == "expert"]
    d_buf = _buffer_numel([(local_numel(t, lay), 1) for t in dense], dense_dp)
    e_buf = _buffer_numel([(t.numel // lay.expert_tp, t.count // lay.ep) for t in experts], edp) if experts else 0
    # Adam moments (2 x fp32) + an fp32 master copy of bf16 weights, sharded over each group's DP.
    opt_per_param = 8 + (4 if pbytes < 4 else 0)
    optim = (sum(local_numel(t, lay) for t in dense) / dense_dp + sum(local_numel(t, lay) for t in experts) / edp) * opt_per_param
    return EngineState(params=(d_buf + e_buf) * pbytes, grads=(d_buf + e_buf) * 4, optimizer=optim)


def offloaded_bytes(st: EngineState, role: str, param: bool, grad: bool, optimizer: bool) -> float:
    """Bytes of one engine that megarl's offload (`*_offload`) moves off the GPU while the rollout
    generates; the reference has only parameters."""
    part = st.params if param else 0.0
    if role != "ref":
        part += (st.grads if grad else 0.0) + (st.optimizer if optimizer else 0.0)
    return part


def activation_bytes(arch: Arch, lay: Layout, stage: int, run: RunShape, critic: bool = False) -> tuple[float, float]:
    """(activations, logits) held at the peak of a backward on a GPU of `stage`.

    Per layer and token, stored for backward (bf16 elements): 4h for the norms' and residuals'
    inputs and outputs (with MLA its latents, with MoE the fp32 router logits), whole on every TP
    rank without sequence parallelism and split over TP with it (`Layout.sp`: divided by tp), plus
    per TP rank the q/k/v and attention output and the MLP's fc1 output and activation; a routed
    layer keeps top-k copies of each token's expert input, fc1 output and activation, spread
    over EP ranks and split over ETP. Flash attention stores no s x s scores, so "selective"
    (core-attention) recompute changes nothing here; "full" keeps only each layer's input, plus
    one layer's working set during its recompute. 1F1B holds (pp - stage) micro-batches;
    interleaving (vpp) adds (pp - 1) / (pp * vpp) of that on the first stage.
    Logits: tokens x vocab/tp x 10 bytes (bf16 logits + fp32 log-softmax and its gradient).
    Context parallelism: each GPU holds 1/cp of the micro-batch's tokens (max_tokens_per_microbatch
    counts the CP group's); megarl's CP attention keeps only the local K/V for backward and holds
    one layer's all-gathered K/V (and, in backward, their gradients) at a time: a working set of
    2 x 2 x tokens x kv width / tp, added once.
    """
    el = DTYPE_BYTES[run.dtype]
    h = arch.hidden
    tokens = run.max_tokens_per_microbatch / lay.cp
    if arch.mla:
        attn_tp = arch.heads * (2 * arch.qk_head_dim + 2 * arch.v_head_dim)
        attn_rep = (arch.q_lora_rank or 0) + arch.kv_lora_rank + arch.qk_rope_head_dim
    else:
        attn_tp = (arch.heads + 2 * arch.kv_heads) * arch.head_dim + arch.q_dim
        attn_rep = 0
    stages = stage_layers(arch.num_layers, lay.pp, lay.first_stage_layers, lay.last_stage_layers)

    # the norm / residual (and router) share: on s/tp tokens per TP rank under sequence parallelism
    rep_split = lay.tp if lay.sp else 1

    def per_token(layer: int) -> float:
        rep = 4 * h + attn_rep
        tp_part = attn_tp
        if arch.is_moe_layer(layer):
            rep += 2 * arch.experts  # fp32 router logits
            # EP ranks exchange tokens; on average each receives top-k copies of as many tokens as it sends.
            expert = arch.topk * (h + 3 * arch.moe_ffn) / lay.expert_tp
            tp_part += 3 * arch.shared_experts * arch.moe_ffn
            return rep / rep_split + tp_part / lay.tp + expert
        return rep / rep_split + (tp_part + 3 * arch.ffn) / lay.tp

    layers = list(stages[stage])
    inflight = lay.pp - stage
    if lay.vpp > 1 and stage == 0:
        inflight *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    if run.recompute == "full":
        stored = len(layers) * h / rep_split * inflight + max((per_token(i) for i in layers), default=0)
    else:
        stored = sum(per_token(i) for i in layers) * inflight
    if lay.cp > 1:
        kv_width = (arch.heads * (arch.qk_head_dim + arch.v_head_dim)) if arch.mla else 2 * arch.kv_heads * arch.head_dim
        stored += 2 * run.max_tokens_per_microbatch * kv_width / lay.tp / tokens  # per local token, like the rest
    logits = 0.0
    if stage == lay.pp - 1 and not critic:
        logits = tokens * arch.padded_vocab(lay.tp) / lay.tp * 10
    return stored * tokens * el, logits


# --- the report ------------------------------------------------------------------------------------
def plan(arch: Arch, lay: Layout, run: RunShape, cl: Cluster) -> dict:
    """Everything the CLI prints, as a JSON-able dict (bytes as GiB, seconds)."""
    dp, edp = check(arch, lay, cl)
    sync = sync_bytes(arch, lay, cl.gpus, dp)
    sync.update(weight_sync_delta(sync["megarl_bytes_per_gpu"], run))
    copy = sync["weight_sync_copy_bytes_per_gpu"]  # delta: kept on the GPU between syncs, in every phase
    # Under LoRA the reference is the actor with its adapters off: no engine of its own.
    roles = ["actor"] + (["critic"] if run.critic else []) + (["ref"] if run.ref and not run.lora_rank else [])
    cap = cl.gpu.memory_gib * GIB
    train_rows, gen_rows, moved_rows = [], [], []
    for s in range(lay.pp):
        states = {r: engine_state(arch, lay, s, run, dp, edp, r) for r in roles}
        if run.optimizer_offload == "cpu":
            for st in states.values():
                st.optimizer = 0.0
        params = sum(st.params for st in states.values())
        grads = sum(st.grads for st in states.values())
        optim = sum(st.optimizer for st in states.values())
        acts = [activation_bytes(arch, lay, s, run, critic=(r == "critic")) for r in roles if r != "ref"]
        act, logits = max(acts, key=sum)
        # During the updates every trainable engine is back on the GPU; the reference is offloaded
        # after its forward when param_offload is set.
        ref_away = states["ref"].params if "ref" in states and run.param_offload else 0.0
        total = params - ref_away + grads + optim + act + logits + copy + run.overhead_gib * GIB
        train_rows.append({"stage": s, "params": params - ref_away, "grads": grads, "optimizer": optim, "activations": act,
                           "logits": logits, "weight_sync_copy": copy, "overhead": run.overhead_gib * GIB, "total": total})
        offloaded = moved = 0.0
        for r, st in states.items():
            part = offloaded_bytes(st, r, run.param_offload, run.grad_offload, run.optimizer_offload == "phases")
            offloaded += part
            # Each engine goes out and back once a step; the actor's parameters twice, because the
            # weight sync reads them back (MegatronEngine.local_weight_shards onloads only the
            # parameters; gradients and optimizer state stay on the host) before they leave again.
            moved += part + (st.params if r == "actor" and run.param_offload else 0.0)
        resident = params + grads + optim - offloaded
        moved_rows.append(moved)
        gen_rows.append({"stage": s, "training_state": resident})
    train = max(train_rows, key=lambda r: r["total"])

    # Rollout: weights in the rollout layout, the engine's budget, the KV cache left in it.
    G = lay.rollout_tp
    rollout_layout = Layout(tp=G, pp=1, ep=1, etp=G)
    weights = sum(local_numel(t, rollout_layout) for t in stage_tensors(arch, rollout_layout, 0)) * 2  # bf16
    budget = run.gpu_memory_fraction * cap
    kv_capacity = max(0.0, budget - weights - run.rollout_workspace_gib * GIB)
    kv_per_token = arch.kv_cache_bytes_per_token(G)
    seq_tokens = run.prompt_len + run.response_len
    seqs_per_instance = run.prompts_per_step * run.samples_per_prompt / (cl.gpus // G)
    kv_needed = seqs_per_instance * seq_tokens * kv_per_token
    resident = max(r["training_state"] for r in gen_rows)
    gen_total = resident + copy + budget + run.overhead_gib * GIB
    gen = {"training_state": resident, "weight_sync_copy": copy, "rollout_weights": weights, "rollout_budget": budget, "kv_cache": kv_capacity,
           "kv_cache_needed_for_whole_batch": kv_needed, "overhead": run.overhead_gib * GIB, "total": gen_total}
    fits_gen = gen_total <= cap and kv_capacity >= seq_tokens * kv_per_token
    fits_train = train["total"] <= cap

    problems = []
    if not fits_train:
        parts = ", ".join(f"{k} {train[k] / GIB:.1f}" for k in ("params", "grads", "optimizer", "activations", "logits", "overhead"))
        problems.append(f"training: {train['total'] / GIB:.1f} GiB per GPU > {cl.gpu.memory_gib:g} GiB on {cl.gpu.name} "
                        f"(pipeline stage {train['stage']}: {parts} GiB)")
    if gen_total > cap:
        problems.append(f"rollout: {gen_total / GIB:.1f} GiB per GPU > {cl.gpu.memory_gib:g} GiB (training state left on the GPU "
                        f"{resident / GIB:.1f} + rollout budget {run.gpu_memory_fraction:g} x {cl.gpu.memory_gib:g} = "
                        f"{budget / GIB:.1f} + overhead {run.overhead_gib:g} GiB); offload more or lower --gpu-memory-fraction")
    if kv_capacity < seq_tokens * kv_per_token:
        problems.append(f"rollout: the KV cache left ({kv_capacity / GIB:.2f} GiB = budget {budget / GIB:.1f} - weights "
                        f"{weights / GIB:.1f} - workspace {run.rollout_workspace_gib:g} GiB) cannot hold one "
                        f"{seq_tokens}-token sequence ({seq_tokens * kv_per_token / GIB:.2f} GiB); raise --rollout-tp")

    link = "nvlink" if cl.gpus <= cl.gpus_per_node or (lay.pp == 1 and max(lay.tp, G) <= cl.gpus_per_node) else "ib"
    bw = (cl.gpu.nvlink_gb_s if link == "nvlink" else cl.gpu.ib_gb_s) * 1e9
    hf = sync["hybridflow_bytes_per_gpu"]
    sync.update(link=link, seconds=sync["bytes_per_sync_per_gpu"] / bw, hybridflow_seconds=None if hf is None else hf / bw)
    times = step_time(arch, run, cl, sync["seconds"], lay, dp)

    def gib(d: dict) -> dict:
        return {k: (round(v / GIB, 6) if isinstance(v, (int, float)) and k != "stage" else v) for k, v in d.items()}

    report = {
        "fits": fits_train and fits_gen,
        "params_total": params_total(arch),
        "params_active": params_active(arch),
        "params_mtp_not_trained": params_mtp(arch),
        "problems": problems,
        "model": asdict(arch),
        "cluster": {"gpus": cl.gpus, "gpus_per_node": cl.gpus_per_node, **asdict(cl.gpu)},
        "layout": {**asdict(lay), "dp": dp, "expert_dp": edp},
        "run": asdict(run),
        "memory_gib": {
            "training": {**gib(train), "fits": fits_train, "per_stage_total": [round(r["total"] / GIB, 6) for r in train_rows]},
            "rollout": {**gib(gen), "fits": fits_gen, "kv_cache_tokens": int(kv_capacity // kv_per_token),
                        "generation_waves": math.ceil(kv_needed / kv_capacity) if kv_capacity else None},
            "offload": {"to_host_and_back_per_step": round(max(moved_rows) / GIB, 6),
                        "host_optimizer_state": round(sum(engine_state(arch, lay, 0, run, dp, edp, r).optimizer for r in roles if r != "ref") / GIB, 3)
                        if run.optimizer_offload == "cpu" else 0.0},
        },
        "sync": sync,
        "step_time_s": times,
    }
    if run.lora_rank:
        report["lora"] = lora_summary(arch, run.lora_rank, train)
    return report


def lora_summary(arch: Arch, rank: int, train: dict) -> dict:
    """Adapter parameters (the model's, all layers), the frozen base, and what the adapters cost per
    GPU on the fullest stage: their gradients (fp32 buffer) and Adam state (the base has neither)."""
    adapters = sum(t.numel * t.count for i in range(arch.num_layers) for t in lora_tensors(arch, i, rank))
    return {"rank": rank, "adapter_params": adapters, "base_params_frozen": params_total(arch),
            "adapter_grads_gib": round(train["grads"] / GIB, 6), "adapter_optimizer_gib": round(train["optimizer"] / GIB, 6)}


def _overlap(t: int, j: int, G: int, q: int) -> float:
    """Fraction of a tensor both in training shard j of t and rollout shard q of G."""
    lo, hi = max(j / t, q / G), min((j + 1) / t, (q + 1) / G)
    return max(0.0, hi - lo)


def weight_sync_delta(full_bytes: float, run: RunShape) -> dict:
    """A sync's bytes per GPU under rollout.weight_sync (full: `full_bytes`, megarl's plan; delta:
    that times the wire share of run.delta_changed_fraction, megarl.layout.sync_cost) and what delta
    keeps on the GPU between syncs: a copy of every segment the GPU sends or receives, about twice
    what it receives (in the micro-DP all-gather each GPU sends about what it receives)."""
    if run.weight_sync not in ("full", "delta"):
        raise ValueError(f"weight sync mode must be 'full' or 'delta', got {run.weight_sync!r}")
    delta = run.weight_sync == "delta"
    share = delta_wire_fraction(run.delta_changed_fraction) if delta else 1.0
    return {"weight_sync": run.weight_sync, "full_bytes_per_sync_per_gpu": full_bytes, "bytes_per_sync_per_gpu": full_bytes * share,
            "delta_changed_fraction": run.delta_changed_fraction if delta else None,
            "weight_sync_copy_bytes_per_gpu": 2 * full_bytes if delta else 0.0}


def sync_bytes(arch: Arch, lay: Layout, gpus: int, dp: int, dtype_bytes: int = 2) -> dict:
    """Weight-sync bytes received per GPU (the max over GPUs).

    megarl (megarl/hybrid/plan.py) moves to each rank exactly its rollout shard minus what its
    training shard already holds; HybridFlow's bound is (t*p - t_g) / (t_g*t*p) * M; the naive
    path (verl's per-tensor all-gather) gathers every full tensor on every rank (dense models).
    """
    G = lay.rollout_tp
    train = ParallelLayout(tp=lay.tp, pp=lay.pp, dp=dp, cp=lay.cp)  # the dense rank map
    q_of = assign_rollout(train, RolloutLayout(G)).rollout_tp_rank
    per_stage = []
    for s in range(lay.pp):
        ts = stage_tensors(arch, lay, s)
        per_stage.append({k: sum(t.numel * t.count for t in ts if t.split == k) for k in ("tp", "rep", "expert")})
    whole = {k: sum(p[k] for p in per_stage) for k in ("tp", "rep", "expert")}
    need = whole["tp"] / G + whole["rep"] + whole["expert"] / G
    model_bytes = sum(whole.values()) * dtype_bytes
    width = lay.tp * dp * lay.cp
    best = naive = 0.0
    for r in range(gpus):
        c = train.coords(r)
        mine = per_stage[c.pp]
        i = r % width
        held = mine["tp"] * _overlap(lay.tp, c.tp, G, q_of[r]) + mine["rep"]
        held += mine["expert"] / lay.ep * _overlap(lay.expert_tp, i % lay.expert_tp, G, q_of[r])
        best = max(best, need - held)
        other = {k: whole[k] - mine[k] for k in whole}
        naive = max(naive, (other["tp"] / lay.tp + other["rep"] if lay.pp > 1 else 0) + whole["tp"] * (lay.tp - 1) / lay.tp)
    return {"megarl_bytes_per_gpu": best * dtype_bytes,
            # HybridFlow's formula assumes each rollout shard contains a training shard (t_g <= t*p)
            "hybridflow_bytes_per_gpu": hybridflow_bytes_per_rank(model_bytes, train, G) if G <= lay.tp * lay.pp else None,
            "naive_bytes_per_gpu": None if arch.is_moe else naive * dtype_bytes,
            "model_bytes": model_bytes}


def step_time(arch: Arch, run: RunShape, cl: Cluster, sync_seconds: float, lay: Layout | None = None, dp: int = 1) -> dict:
    """Seconds per PPO step by phase: FLOPs / (GPUs x peak x assumed MFU); the training-side
    phases also wait for the pipeline bubble, (pp - 1) / (vpp x micro-batches per DP rank)."""
    P, R = run.prompt_len, run.response_len
    seqs = run.prompts_per_step * run.samples_per_prompt
    tokens = seqs * (P + R)
    lay = lay or Layout()
    # max_tokens_per_microbatch counts a CP group's tokens (megarl.engine.context_parallel): dp excludes cp
    micro_batches = max(1, math.ceil(tokens / dp / run.max_tokens_per_microbatch))
    bubble = 1 + (lay.pp - 1) / (lay.vpp * micro_batches)
    peak = cl.gpus * cl.gpu.bf16_tflops * 1e12 / bubble  # the gen phase below undoes it

    def fwd(critic=False):
        return tokens * forward_flops_per_token(arch, (P + R) / 2, critic)

    gen = seqs * (P * forward_flops_per_token(arch, P / 2) + R * forward_flops_per_token(arch, P + R / 2))
    out = {"sync": sync_seconds, "gen": gen / (peak * bubble * run.gen_mfu), "old_log_prob": fwd() / (peak * run.mfu)}
    if run.ref:
        out["ref"] = fwd() / (peak * run.mfu)
    if run.critic:
        out["values"] = fwd(True) / (peak * run.mfu)
        out["update_critic"] = run.ppo_epochs * tokens * train_flops_per_token(arch, P + R, run.recompute, True) / (peak * run.mfu)
    out["update_actor"] = run.ppo_epochs * tokens * train_flops_per_token(arch, P + R, run.recompute) / (peak * run.mfu)
    total = sum(out.values())
    return {**{k: round(v, 3) for k, v in out.items()}, "total": round(total, 3), "sync_share": round(sync_seconds / total, 4),
            "assumed_mfu": run.mfu, "assumed_gen_mfu": run.gen_mfu, "pipeline_bubble": round(bubble - 1, 4)}


def balanced_split(num_layers: int, pp: int) -> tuple[int | None, int | None] | None:
    """(first, last) stage layers for pp stages (None = as many as a middle stage): the split with
    the fewest layers on the busiest stage; None when no split exists."""
    if num_layers % pp == 0:
        return None, None
    best = None
    options = [None, *range(1, -(-num_layers // pp) + 1)]
    for f in options:
        for last in options:
            try:
                sizes = [len(r) for r in stage_layers(num_layers, pp, f, last)]
            except ValueError:
                continue
            key = (max(sizes), sizes[0] + sizes[-1])  # then lighter end stages (they hold embedding and head)
            if best is None or key < best[0]:
                best = (key, (f, last))
    return None if best is None else best[1]


def search(arch: Arch, run: RunShape, cl: Cluster, top: int = 5, base: Layout | None = None) -> list[dict]:
    """Layouts that fit, fastest estimated step first: tp (powers of 2 within a node; 1 for MoE,
    to keep the search of the 671B class short: MoE at tp > 1 trains with sequence parallelism,
    plan such a layout directly), pp up
    to 32 (uneven end stages when the layers do not divide), ep (MoE, etp 1), rollout tp (powers of
    2 up to 64); cp stays as given."""
    base = base or Layout()
    found = []
    pow2 = [2**i for i in range(12)]
    for tp in [1] if arch.is_moe else [t for t in pow2 if t <= cl.gpus_per_node]:
        for pp in range(1, min(arch.num_layers, 32) + 1):
            split = balanced_split(arch.num_layers, pp)
            if split is None or cl.gpus % (tp * pp * base.cp):
                continue
            dp = cl.gpus // (tp * pp * base.cp)
            eps = [e for e in range(1, arch.experts + 1) if arch.experts % e == 0 and (tp * dp * base.cp) % e == 0] if arch.is_moe else [1]
            for ep in eps:
                for G in [g for g in pow2 if g <= min(cl.gpus, 64) and cl.gpus % g == 0 and arch.heads % g == 0]:
                    lay = Layout(tp=tp, pp=pp, first_stage_layers=split[0], last_stage_layers=split[1], ep=ep,
                                 etp=1 if arch.is_moe else None, cp=base.cp, rollout_tp=G)
                    try:
                        p = plan(arch, lay, run, cl)
                    except ValueError:
                        continue
                    if p["fits"]:
                        found.append({"layout": {k: v for k, v in p["layout"].items() if v is not None},
                                      "step_time_s": p["step_time_s"]["total"], "sync_share": p["step_time_s"]["sync_share"],
                                      "training_gib": p["memory_gib"]["training"]["total"], "rollout_gib": p["memory_gib"]["rollout"]["total"]})
    found.sort(key=lambda f: (f["step_time_s"], f["training_gib"]))
    return found[:top]
