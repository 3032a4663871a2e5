"""The run configuration's schema: one dataclass per section, one field per knob.

Every knob is a field whose metadata holds its help text and numeric range (`knob`); nested
sections are `section`s. YAML is only the serialisation of `Config` (megarl.config.loader);
docs/configuration.md is rendered from these fields (megarl.config.docs). This module imports
neither torch nor the disk. It is long because it holds every knob of a run, one documented field
each: one file is the one place to look a key up, and the fields carry no logic to split out.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megarl.models.families import DENSE_FAMILIES, MOE_FAMILIES


class ConfigError(ValueError):
    """A bad config file, key or value; the message is one line a user can act on."""


def knob(default: Any, help: str, **bounds: float) -> Any:
    """A config field: default, one-line help, optional numeric bounds (ge, gt, le, lt)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **bounds})
    return field(default=default, metadata={"help": help, **bounds})


def section(cls: type, help: str, **defaults: Any) -> Any:
    """A nested config section; `defaults` override the section class's own defaults here (a dict
    value overrides fields of a nested section: `optim={"lr": 1e-5}`)."""
    return field(default_factory=lambda: _with_defaults(cls(), defaults), metadata={"help": help})


def _with_defaults(obj: Any, defaults: dict) -> Any:
    changes = {}
    for name, value in defaults.items():
        current = getattr(obj, name)
        changes[name] = _with_defaults(current, value) if isinstance(value, dict) and dataclasses.is_dataclass(current) \
            else copy.deepcopy(value)
    return dataclasses.replace(obj, **changes)


@functools.lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a config class (this module uses postponed annotations)."""
    return typing.get_type_hints(cls)


# Spelled out (config must not import torch); a test keeps them equal to megarl.algorithms'
# KL_KINDS_ALL (+ "full") and AGG_MODES.
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+", "full"]
ADV_ESTIMATORS_WITH_GROUPS = ("grpo", "rloo")  # baselines from the other samples of a prompt
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# The families whose tiny model these options describe (megarl.models.families); the 671B class's own
# options (expert groups, MLA ranks) are make_tiny_model's flags, not config keys.
TinyArch = Literal[DENSE_FAMILIES + MOE_FAMILIES]


@dataclass
class MakeTinyConfig:
    """Options of megarl.tools.make_tiny_model (same names as its keyword arguments)."""

    enable: bool = knob(False, "create a tiny random model at model.path when that directory does not exist (CPU demo)")
    arch: TinyArch = knob("llama", "model family")
    tokenizer: Literal["digits", "bpe"] = knob("digits", "digits: one token per character of 0-9 + - * = ; : ? # space; bpe: small byte-level BPE")
    hidden: int = knob(64, "hidden size", ge=1)
    intermediate: int = knob(256, "MLP hidden size", ge=1)
    layers: int = knob(2, "transformer layers", ge=1)
    heads: int = knob(4, "attention heads (must divide hidden)", ge=1)
    kv_heads: int = knob(2, "key/value heads (must divide heads)", ge=1)
    max_positions: int = knob(64, "maximum sequence length", ge=1)
    tie: bool = knob(False, "tie input and output embeddings")
    init_std: float = knob(0.1, "std of the random initialisation of matrices", gt=0)
    seed: int = knob(0, "seed of the random initialisation", ge=0)


@dataclass
class ModelConfig:
    path: str = knob("", "the actor: a Hugging Face model directory (config.json, tokenizer, safetensors) or "
                          "hub id (org/name[@revision], fetched into the Hugging Face cache; docs/operations.md)")
    dtype: Literal["float32", "bfloat16"] = knob("bfloat16", "parameter / compute dtype (optimizer state stays float32)")
    sequence_packing: bool = knob(True, "remove padding: pack each micro-batch's sequences into one row "
                                        "(Megatron thd format; verl's use_remove_padding); false = right-padded rows")
    freeze_router: bool = knob(False, "MoE: keep the router (gate) weights of the trained models fixed (left out of the optimizer)")
    make_tiny: MakeTinyConfig = section(MakeTinyConfig, "tiny random model for CPU demos")


@dataclass
class ParallelConfig:
    tp: int = knob(1, "tensor-parallel size of actor, critic and reference training", ge=1)
    pp: int = knob(1, "pipeline-parallel size", ge=1)
    ep: int = knob(1, "expert-parallel size (MoE models)", ge=1)
    etp: Optional[int] = knob(None, "expert tensor-parallel size; null = parallel.tp", ge=1)
    vpp: Optional[int] = knob(None, "virtual pipeline stages per pipeline rank (interleaved 1F1B schedule; each stage's "
                                    "layers are cut into vpp equal model chunks); null = off", ge=1)
    first_stage_layers: Optional[int] = knob(None, "layers of the first pipeline stage when it is to hold fewer (it also "
                                                    "holds the embedding); null = an even share", ge=1)
    last_stage_layers: Optional[int] = knob(None, "layers of the last pipeline stage when it is to hold fewer (it also "
                                                   "holds the output layer and the loss); null = an even share", ge=1)
    cp: int = knob(1, "context-parallel size: each packed sequence split over cp GPUs (long sequences; needs "
                          "model.sequence_packing=true and pp=1; docs/long_context.md)", ge=1)
    sequence_parallel: bool = knob(True, "sequence parallelism at tp > 1 (Megatron's sequence_parallel, as in the verl, "
                                         "NeMo-RL and Megatron-Bridge recipes): norms, dropout and MoE routing run on 1/tp "
                                         "of the tokens; needed to train MoE models at tp > 1; no effect at tp 1")


@dataclass
class MultiTurnConfig:
    environment: Optional[str] = knob(None, "'module:Class' of a megarl.agents.Environment (module found on PYTHONPATH): each "
                                            "sample is an episode of policy turns and environment observations; null = one "
                                            "turn (docs/agents.md)")
    max_turns: int = knob(4, "policy turns per episode at most", ge=1)
    max_tokens_per_turn: Optional[int] = knob(None, "tokens per policy turn at most; null = max_total_tokens", ge=1)
    max_total_tokens: Optional[int] = knob(None, "tokens of the whole response (policy and environment turns) at most; "
                                                 "null = rollout.max_new_tokens, which bounds it", ge=1)
    max_concurrency: int = knob(8, "environment calls (reset, step) running at once on this rank's thread pool", ge=1)
    timeout_s: float = knob(30.0, "seconds one environment call may take; past it the call becomes an observation naming "
                                  "the timeout (counted in agents/env_timeouts) and the episode goes on", gt=0)
    chat_template: bool = knob(False, "observations are the tokenizer's chat-template rendering of a 'tool' message after "
                                      "the policy's turn (the template's own boundary tokens included) instead of their "
                                      "plain encoding; each episode is checked against the template's full rendering "
                                      "(agents/template_mismatch)")


@dataclass
class WeightSyncConfig:
    mode: Literal["full", "delta"] = knob(
        "full", "full: every sync sends each rollout shard whole; delta: after a full sync, each bucket carries only the "
                "elements whose rollout-dtype value changed (indices or a bitmask with the values, or the bucket in full "
                "past the break-even), at the price of a copy of every segment a rank sends or receives kept between syncs "
                "(docs/rollout.md, 'Delta weight sync')")
    full_every: int = knob(50, "with mode=delta, every full_every-th sync sends everything in full (the first one always does)",
                           ge=1)


@dataclass
class FleetConfig:
    """rollout.placement=fleet: rollout servers outside the torchrun world join the trainer's endpoint
    (docs/rollout.md, "Fleet")."""

    host: str = knob("127.0.0.1", "interface the training job's fleet endpoint binds (never all interfaces unless named, "
                                  "e.g. 0.0.0.0); servers connect with --trainer HOST:PORT")
    port: int = knob(29600, "TCP port of the fleet endpoint", ge=1, le=65535)
    token_file: str = knob("fleet.token", "file holding the run's token, which a server must show to join; created with a "
                                          "fresh random token, readable by its owner only, when missing (relative paths are "
                                          "under trainer.run_dir)")
    heartbeat_s: float = knob(10.0, "a server silent this long is lost (its unfinished requests go to the others); servers "
                                    "send a heartbeat every heartbeat_s / 3", gt=0)
    min_servers: int = knob(1, "the trainer waits (saying so every heartbeat_s) until this many servers hold the current "
                               "weights before it hands out a step's requests", ge=1)


@dataclass
class RolloutConfig:
    engine: Literal["hf", "vllm", "sglang"] = knob("hf", "inference engine that generates responses (hf runs on CPU); under "
                                                              "rollout.placement=fleet the one its servers run (their --engine)")
    tp: int = knob(1, "tensor-parallel size of the inference engine", ge=1)
    samples_per_prompt: int = knob(1, "responses sampled per prompt (GRPO/RLOO need >= 2)", ge=1)
    temperature: float = knob(1.0, "sampling temperature", gt=0)
    top_p: float = knob(1.0, "nucleus sampling mass", gt=0, le=1)
    top_k: int = knob(-1, "top-k sampling; -1 = off", ge=-1)
    max_new_tokens: int = knob(512, "response length limit, tokens", ge=1)
    stop_token_ids: list[int] = knob([], "extra token ids that end a response (eos does too, unless rollout.ignore_eos)")
    ignore_eos: bool = knob(False, "eos does not end a response: each runs to max_new_tokens or a rollout.stop_token_ids "
                                   "token (fixed-length rollouts for throughput measurements, as verl's rollout.ignore_eos)")
    banned_token_ids: list[int] = knob([], "token ids never sampled, in every engine (e.g. pad/bos/unk a policy could learn to emit)")
    gpu_memory_utilization: float = knob(0.5, "fraction of GPU memory the engine may take (vllm/sglang)", gt=0, le=1)
    bucket_bytes: int = knob(512 * 2**20, "bytes per bucket of the actor -> engine weight stream", ge=1)
    weight_sync: WeightSyncConfig = section(WeightSyncConfig, "what each weight sync sends: everything or the changes "
                                                              "(docs/rollout.md)")
    memory_check: bool = knob(True, "at start-up, on CUDA with engine vllm/sglang: estimate the training state left on the GPU "
                                     "while the engine generates (Adam moments included) plus gpu_memory_utilization of the "
                                     "device; turn on the offloads left null, or stop naming the knob (docs/operations.md)")
    verify_weights: bool = knob(True, "after each weight sync, compare engine and actor log-probs: the first sync of a run "
                                      "fails loudly over the limit, later ones fire guard/weight_sync (docs/rollout.md)")
    verify_weights_mean_atol: Optional[float] = knob(
        None, "limit on the mean |engine - actor| token log-prob of that check; null = the dtype's calibrated limit "
              "(float32 1e-4, bfloat16 0.07, float16 0.02: megarl.hybrid.verify.SYNC_CHECKS)", gt=0)
    placement: Literal["colocated", "separate", "fleet"] = knob(
        "colocated", "colocated: every rank trains and generates, taking turns; separate: the last rollout.num_ranks ranks "
                     "of the torchrun world only generate and the others only train (docs/async_rl.md); fleet: rollout "
                     "servers outside the torchrun world join and leave while training goes on (docs/rollout.md)")
    num_ranks: int = knob(0, "ranks that only generate with rollout.placement=separate (the last ones of the world)", ge=0)
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "multi-turn episodes with an environment (tool use; docs/agents.md)")
    fleet: FleetConfig = section(FleetConfig, "rollout.placement=fleet: the endpoint rollout servers join (docs/rollout.md)")


@dataclass
class ArithmeticDataConfig:
    kind: Literal["copy", "repeat", "add"] = knob("copy", "task: copy the digits, repeat the first digit, or add")
    num_digits: int = knob(3, "digits per prompt operand", ge=1, le=9)
    train_size: int = knob(20000, "rows of the generated train split", ge=1)
    val_size: int = knob(512, "rows of the generated validation split", ge=1)


@dataclass
class DataConfig:
    train_files: list[str] = knob([], "Parquet files of training prompts (launch/prepare_data.py writes them)")
    val_files: list[str] = knob([], "Parquet files of validation prompts")
    prompt_key: str = knob("prompt", "column holding the prompt text")
    ground_truth_key: str = knob("ground_truth", "column holding the reference answer given to the reward")
    apply_chat_template: bool = knob(False, "wrap each prompt as a user message with the tokenizer's chat template")
    max_prompt_tokens: int = knob(512, "longer prompts are dropped (the count is logged)", ge=1)
    prompts_per_step: int = knob(256, "prompts per PPO step, global (responses = prompts * rollout.samples_per_prompt)", ge=1)
    shuffle: bool = knob(True, "reshuffle the prompts each epoch (seeded by trainer.seed and the epoch)")
    auto_prepare: Optional[Literal["arithmetic", "gsm8k", "lookup"]] = knob(
        None, "write this dataset to train_files[0] (and val_files[0]) when train_files[0] is missing (lookup: the tool "
              "demo's task, megarl.agents.lookup, sized by data.arithmetic's num_digits, train_size, val_size)")
    gsm8k_source: Optional[str] = knob(None, "directory with GSM8K train.jsonl/test.jsonl for auto_prepare; null = ../shared/data/gsm8k")
    arithmetic: ArithmeticDataConfig = section(ArithmeticDataConfig, "the generated arithmetic demo task")


@dataclass
class LoraConfig:
    rank: int = knob(0, "LoRA rank of the role's adapters; 0 = train every weight (no adapters)", ge=0)
    alpha: float = knob(16.0, "LoRA alpha: the adapter output is scaled by alpha / rank (PEFT's)", gt=0)
    dropout: float = knob(0.0, "dropout on the adapters' input (training passes only)", ge=0, lt=1)
    target_modules: Optional[list[str]] = knob(None, "HF projection names that get adapters (q_proj, k_proj, v_proj, o_proj, "
                                                     "gate_proj, up_proj, down_proj, MLA's q_a_proj/q_b_proj/kv_a_proj_with_mqa/"
                                                     "kv_b_proj, the experts'); null = every linear layer of the decoder")


@dataclass
class RoleOptimConfig:
    """Optimizer and LR schedule of one trained role, counted in *trainer* steps (as verl counts).

    The engine's `megarl.engine.engine.OptimConfig` counts optimizer steps instead;
    `megarl.step.engine_options.engine_config` converts (x ppo_epochs * ppo_mini_batches)."""

    lr: float = knob(1e-6, "peak learning rate", gt=0)
    betas: tuple[float, float] = knob((0.9, 0.999), "Adam betas")
    weight_decay: float = knob(0.01, "decoupled weight decay", ge=0)
    eps: float = knob(1e-8, "Adam epsilon", gt=0)
    max_grad_norm: float = knob(1.0, "clip the global gradient norm to this", gt=0)
    warmup_steps: int = knob(0, "linear warmup, in trainer steps (the schedule advances once per PPO step, as in verl)", ge=0)
    schedule: Literal["constant", "cosine"] = knob("constant", "learning-rate schedule after warmup")
    min_lr: float = knob(0.0, "learning rate the cosine schedule reaches at trainer.total_steps", ge=0)


@dataclass
class RoleConfig:
    """What every trained role (actor, critic) has: its optimizer, the update's epoch x mini-batch
    structure, micro-batching, offload and recomputation. Role-specific defaults (the critic's
    lr and micro-batch size) are set where `Config` declares the role."""

    optim: RoleOptimConfig = section(RoleOptimConfig, "optimizer and learning-rate schedule, counted in trainer steps")
    ppo_epochs: int = knob(1, "passes over each step's responses", ge=1)
    ppo_mini_batches: int = knob(4, "optimizer steps per epoch: the step's responses are split into this many mini-batches", ge=1)
    max_tokens_per_microbatch: int = knob(16384, "tokens per forward/backward micro-batch, per DP rank", ge=1)
    loss_agg_mode: LossAggMode = knob("token-mean", "how token losses become the batch loss (normalised over the global batch)")
    param_offload: Optional[bool] = knob(None, "keep parameters on CPU outside the update; null = off, unless the start-up "
                                               "memory check turns it on (rollout.memory_check)")
    grad_offload: Optional[bool] = knob(None, "keep gradients on CPU outside the update; null = off, unless the start-up "
                                              "memory check turns it on (rollout.memory_check)")
    optimizer_offload: Optional[bool] = knob(None, "keep optimizer state (Adam moments, fp32 main parameters) on CPU outside "
                                                   "the update; null = off, unless the start-up memory check turns it on "
                                                   "(rollout.memory_check)")
    recompute: Literal["none", "selective", "full"] = knob("none", "activation recomputation granularity")
    lora: LoraConfig = section(LoraConfig, "low-rank adapters: train these instead of the weights (base frozen)")


@dataclass
class ActorConfig(RoleConfig):
    clip_ratio: float = knob(0.2, "PPO ratio clip epsilon", gt=0)
    clip_ratio_low: Optional[float] = knob(None, "lower clip epsilon; null = clip_ratio", gt=0)
    clip_ratio_high: Optional[float] = knob(None, "upper clip epsilon (DAPO clip-higher); null = clip_ratio", gt=0)
    clip_ratio_c: float = knob(3.0, "dual-clip bound for negative advantages (Ye et al. 2020)", gt=1)
    entropy_coeff: float = knob(0.0, "entropy bonus coefficient", ge=0)
    use_kl_loss: bool = knob(False, "add a KL(actor || ref) loss term (GRPO style)")
    kl_loss_coef: float = knob(0.001, "coefficient of the KL loss", ge=0)
    kl_loss_type: KLKind = knob("low_var_kl", "KL estimator of the KL loss (a trailing + : straight-through k2 gradient)")
    policy_loss: Literal["ppo", "gspo"] = knob("ppo", "token-level PPO or sequence-level GSPO ratio")
    routing_replay: bool = knob(False, "MoE: the actor's old-log-prob and update passes route every token to the experts the "
                                       "rollout engine chose (slime's --use-routing-replay; rollout.engine=hf)")
    moe_aux_loss_coeff: float = knob(0.0, "MoE: coefficient of the auxiliary load-balancing loss in the actor's loss; 0 = off "
                                          "(the RL default)", ge=0)
    moe_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss"] = knob(
        "aux_loss", "MoE: Megatron's kind of load-balancing loss when actor.moe_aux_loss_coeff > 0")


@dataclass
class CriticConfig(RoleConfig):
    model_path: Optional[str] = knob(None, "HF directory or hub id to initialise the critic trunk from; null = model.path")
    vf_clip: float = knob(0.5, "value clip range around the rollout values", gt=0)


@dataclass
class RefConfig:
    param_offload: Optional[bool] = knob(None, "keep the reference model on CPU between its forward passes; null = off, "
                                               "unless the start-up memory check turns it on (rollout.memory_check)")
    separate_model: bool = knob(False, "with actor.lora: build a separate reference model instead of using the actor with "
                                       "its adapters off (the default: no second model)")


@dataclass
class OverlongBufferConfig:
    len: int = knob(0, "DAPO's soft overlong penalty: responses longer than rollout.max_new_tokens - len tokens lose score "
                       "linearly, up to penalty_factor at max_new_tokens (verl's reward.overlong_buffer); 0 = off", ge=0)
    penalty_factor: float = knob(1.0, "score taken from a response of rollout.max_new_tokens tokens", ge=0)


@dataclass
class RewardConfig:
    kind: Literal["auto", "gsm8k", "arithmetic", "function", "model", "none"] = knob(
        "auto", "auto picks the rule by each row's data_source (gsm8k, arithmetic); none: no task reward, every score 0 "
                "(on-policy distillation alone, algorithm.distill)")
    function: Optional[str] = knob(None, "'module:function' for kind=function, called like megarl.rewards.RewardFn")
    model_path: Optional[str] = knob(None, "reward model (HF directory or hub id, with a scalar head) for kind=model")
    gsm8k_method: Literal["strict", "flexible"] = knob("strict", "strict: answer after '####'; flexible: last number")
    format_score: float = knob(0.0, "score of a well-formed but wrong answer")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO's soft overlong penalty, added to every score")


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = knob("fixed", "fixed coefficient or adaptive (Ziegler et al. 2019)")
    kl_coef: float = knob(0.001, "(initial) KL coefficient", ge=0)
    target_kl: float = knob(0.1, "adaptive: KL the controller steers to", gt=0)
    horizon: int = knob(10000, "adaptive: controller horizon, in responses", ge=1)
    min_coef: float = knob(0.0, "lower bound of the coefficient", ge=0)
    max_coef: Optional[float] = knob(None, "upper bound of the coefficient; null = none", ge=0)


@dataclass
class FilterGroupsConfig:
    enable: bool = knob(False, "DAPO dynamic sampling: drop groups whose samples all score the same (no advantage "
                               "signal) and generate from further prompts until data.prompts_per_step groups remain")
    max_num_gen_batches: int = knob(10, "generation rounds per step (each of data.prompts_per_step prompts) before the "
                                        "step fails with an error naming this knob", ge=1)


@dataclass
class RolloutCorrectionConfig:
    mode: Literal["none", "tis", "mis", "icepop", "decoupled"] = knob(
        "none", "off-policy correction between the rollout engine's log-probs (behaviour) and the trainer's (docs/"
                "algorithms.md): tis truncates the ratio, mis rejects sequences outside a band, icepop zeroes tokens "
                "outside a band, decoupled is AReaL's behaviour-weighted PPO; none logs rollout_corr/kl only")
    rollout_is: Literal["token", "sequence"] = knob("token", "tis: per-token ratio or the sequence's product ratio (verl)")
    rollout_is_threshold: float = knob(2.0, "tis: truncation C of the importance weight, min(r, C) (verl)", gt=0)
    rollout_rs_threshold: float = knob(2.0, "mis: upper bound of the sequence ratio; above it the sequence is rejected "
                                            "(verl)", gt=0)
    rollout_rs_threshold_lower: Optional[float] = knob(None, "mis: lower bound of the sequence ratio; null = "
                                                             "1 / rollout_rs_threshold (verl)", gt=0)
    icepop_low: float = knob(0.5, "icepop: tokens whose ratio is below this get weight 0 (the paper's 0.5)", gt=0)
    icepop_high: float = knob(5.0, "icepop: tokens whose ratio is above this get weight 0 (the paper's 5)", gt=0)
    behav_imp_weight_cap: Optional[float] = knob(None, "decoupled: tokens whose behaviour weight pi_prox / pi_behav "
                                                       "exceeds this get weight 0; null = no cap (AReaL)", gt=0)


@dataclass
class DistillConfig:
    teacher_path: Optional[str] = knob(
        None, "on-policy distillation: a Hugging Face model directory (the teacher: frozen, laid out like the reference model, "
              "same tokenizer and vocabulary as model.path, may be larger) that scores each sampled response token by "
              "token; null = off (docs/algorithms.md)")
    coef: float = knob(1.0, "weight of the per-token reverse KL(policy || teacher) term", ge=0)
    mode: Literal["reward", "loss"] = knob(
        "reward", "reward: add coef * (teacher_logp - policy_logp) to each token's reward before the advantages; loss: add "
                  "coef * the per-token reverse-KL estimate to the actor's loss (as actor.use_kl_loss does)")


@dataclass
class AlgorithmConfig:
    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "remax"] = knob(
        "gae", "advantage estimator; gae trains a critic")
    gamma: float = knob(1.0, "discount factor", ge=0, le=1)
    lam: float = knob(1.0, "GAE lambda", ge=0, le=1)
    norm_adv_by_std_in_grpo: bool = knob(True, "GRPO: divide by the group's score std (false = Dr. GRPO)")
    use_kl_in_reward: bool = knob(False, "subtract kl_coef * KL(actor || ref) from the token rewards")
    kl_penalty: KLKind = knob("kl", "KL estimator of the in-reward penalty")
    kl_ctrl: KLControlConfig = section(KLControlConfig, "KL coefficient controller")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO dynamic sampling (verl's algorithm.filter_groups)")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "off-policy correction of the engine/trainer mismatch and staleness (verl's "
                                 "algorithm.rollout_correction)")
    distill: DistillConfig = section(DistillConfig, "on-policy distillation from a teacher model (reverse KL per token)")


@dataclass
class GuardsConfig:
    kl_threshold: float = knob(0.0, "mean token KL(actor || ref) of a rollout above which kl_action fires; 0 = off", ge=0)
    kl_action: Literal["raise_coef", "skip_update"] = knob(
        "raise_coef", "raise_coef: double the in-reward KL coefficient (algorithm.kl_ctrl, up to max_coef; acts with "
                      "use_kl_in_reward) from the next step; skip_update: skip the actor update of that step")
    grad_norm_threshold: float = knob(0.0, "skip an optimizer step whose grad norm (before clipping) exceeds this; 0 = off", ge=0)
    nan_skip_and_restore: bool = knob(True, "skip a step with non-finite loss/grad norm; restore the last checkpoint after nan_patience in a row")
    nan_patience: int = knob(3, "consecutive non-finite steps before restoring", ge=1)
    reward_collapse_fraction: float = knob(
        0.0, "score below this fraction of its EMA: halve the LRs and roll back to the last checkpoint; 0 = off", ge=0, lt=1)
    reward_ema_steps: int = knob(10, "EMA window of the score, in steps (also the steps before the guard arms)", ge=1)


LOGGERS = ("console", "jsonl", "mlflow", "tensorboard", "wandb")
Logger = Literal["console", "jsonl", "mlflow", "tensorboard", "wandb"]


@dataclass
class TrackingConfig:
    loggers: list[Logger] = knob(["console", "jsonl", "mlflow"], "where step metrics go: console (progress bar or lines), "
                                 "jsonl (<run_dir>/metrics.jsonl), mlflow, tensorboard (<run_dir>/tensorboard), wandb")
    mlflow: Optional[bool] = knob(None, "older switch, still read: false removes mlflow from tracking.loggers; true "
                                  "needs mlflow in tracking.loggers")
    tracking_uri: Optional[str] = knob(None, "MLflow tracking URI; null = a local store inside trainer.run_dir")
    experiment: str = knob("megarl", "MLflow experiment name")
    run_name: Optional[str] = knob(None, "MLflow run name; null = basename of trainer.run_dir")
    progress_bar: bool = knob(True, "console progress bar over steps with score, pg_loss and kl")
    wandb_project: Optional[str] = knob(None, "W&B project; null = an offline run (nothing leaves the machine)")
    wandb_entity: Optional[str] = knob(None, "W&B entity (team or user) of an online run")
    wandb_mode: Literal["auto", "offline", "online"] = knob(
        "auto", "offline: files under <run_dir>/wandb only (`wandb sync` uploads them later); online needs "
                   "tracking.wandb_project and a W&B key; auto: online when both are given, else offline")
    prometheus_port: Optional[int] = knob(None, "rank 0 serves live metrics at http://<prometheus_host>:<port>/metrics; "
                                          "null = off, 0 = any free port (printed)", ge=0, le=65535)
    prometheus_host: str = knob("127.0.0.1", "address the metrics endpoint binds to (localhost only by default; "
                                "0.0.0.0 for a Prometheus on another machine)")
    sample_ids: bool = knob(False, "rank 0 appends each step's trained samples (dataset row, prompt and sample index, the "
                                   "policy version of each token; under rollout.placement=fleet also the server that generated it) to "
                                   "<run_dir>/samples.jsonl; a resume drops the steps it runs "
                                   "again, as in metrics.jsonl (audits data order and staleness across restarts)")

    def active_loggers(self) -> tuple[str, ...]:
        """tracking.loggers less mlflow when the older switch tracking.mlflow is false, in LOGGERS order."""
        chosen = set(self.loggers) - ({"mlflow"} if self.mlflow is False else set())
        return tuple(name for name in LOGGERS if name in chosen)


@dataclass
class AsyncConfig:
    """The asynchronous schedule (YAML section `async`; docs/async_rl.md)."""

    max_staleness: int = knob(0, "K: samples may come from a policy up to K updates older than the one trained; 0 = "
                                 "synchronous. K >= 1 needs rollout.placement=separate or fleet", ge=0)
    partial_rollout: bool = knob(False, "a weight update interrupts running requests, which keep their tokens and log-probs "
                                        "and continue under the new weights (each token remembers its version)")


@dataclass
class TrainerConfig:
    run_dir: str = knob("runs/megarl", "checkpoints, metrics.jsonl, resolved config and the MLflow store go here")
    total_steps: int = knob(100, "PPO steps to run", ge=1)
    seed: int = knob(1, "seed of data order, sampling and init; randomness never depends on the layout", ge=0)
    critic_warmup: int = knob(0, "verl's critic warm-up: the actor is first updated at this step (steps count from 1), so "
                                 "steps 1 .. critic_warmup-1 train only the critic; 0 and 1 = no warm-up; ignored without a critic "
                                 "(adv_estimator other than gae), so one config serves both", ge=0)
    save_every_steps: int = knob(0, "checkpoint every N steps (and at the end); 0 = never", ge=0)
    keep_last_checkpoints: int = knob(0, "delete older complete checkpoints beyond this many; 0 = keep all", ge=0)
    resume: str = knob("auto", "auto (latest complete checkpoint in run_dir, if any) | never | a checkpoint path")
    resume_allow_changes: bool = knob(False, "resume even though settings that change results differ from the run's last segment")
    log_every: int = knob(1, "console log interval, steps (metrics.jsonl gets every step)", ge=1)
    val_every_steps: int = knob(0, "validate every N steps on data.val_files; 0 = never", ge=0)
    profile_steps: list[int] = knob([], "steps recorded by trainer.profiler on every rank (e.g. [3]); other steps run "
                                    "unprofiled at no cost")
    profiler: Literal["torch", "nvtx"] = knob(
        "torch", "torch: a Chrome trace per rank in <run_dir>/profile/step_N/ (open in chrome://tracing or Perfetto); "
                 "nvtx: NVTX ranges + cudaProfilerStart/Stop around those steps for `nsys profile --capture-range=cudaProfilerApi`")
    collective_timeout_s: float = knob(600.0, "a rank that stops (no heartbeat, or a phase behind the others for this "
                                       "long) ends the run with a message naming it and its phase", gt=0)


@dataclass
class SupervisedConfig:
    """The supervised stages: launch/sft.py and launch/reward_model.py (docs/sft_rm.md)."""

    rows_per_step: int = knob(64, "SFT examples or preference pairs per step (one optimizer step), global; divisible by the "
                                  "data-parallel size", ge=1)
    max_length: int = knob(512, "tokens of a row at most (SFT: prompt + response; a preference side: prompt + answer + 1); "
                                "a longer row is a bad row", ge=2)
    bad_rows: Literal["error", "skip"] = knob("error", "a bad row (empty response, chosen equal to rejected, longer than "
                                                       "max_length): error = stop naming file, row and column (exit 2); "
                                                       "skip = leave it out, counted in one line per file")


@dataclass
class Config:
    model: ModelConfig = section(ModelConfig, "the actor model")
    parallel: ParallelConfig = section(ParallelConfig, "Megatron training layout")
    rollout: RolloutConfig = section(RolloutConfig, "response generation")
    data: DataConfig = section(DataConfig, "prompts")
    actor: ActorConfig = section(ActorConfig, "policy update")
    critic: CriticConfig = section(CriticConfig, "value model (adv_estimator=gae)",
                                   optim={"lr": 1e-5}, max_tokens_per_microbatch=32768)
    ref: RefConfig = section(RefConfig, "frozen reference policy")
    reward: RewardConfig = section(RewardConfig, "scoring of responses")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages and KL control")
    guards: GuardsConfig = section(GuardsConfig, "automatic reactions to unhealthy steps")
    tracking: TrackingConfig = section(TrackingConfig, "metrics")
    trainer: TrainerConfig = section(TrainerConfig, "run control")
    supervised: SupervisedConfig = section(SupervisedConfig, "SFT and reward-model training (launch/sft.py, launch/reward_model.py)")
    # YAML key `async` (a Python keyword): yaml_key / field_name translate
    async_: AsyncConfig = section(AsyncConfig, "asynchronous training with bounded staleness (separate placement)")


def yaml_key(name: str) -> str:
    """A schema field's key in YAML and overrides: `async_` is written `async`."""
    return "async" if name == "async_" else name


def field_name(key: str) -> str:
    """The schema field of a YAML key (the inverse of yaml_key)."""
    return "async_" if key == "async" else key


# ------------------------------------------------------------------------------------------
# Values against the schema's types (used when loading and again when validating)
# ------------------------------------------------------------------------------------------

def convert(value: Any, tp: Any, key: str) -> Any:
    """Check (and lightly coerce) one YAML value against its annotated type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        try:
            return convert(value, inner, key)
        except ConfigError as e:
            raise ConfigError(f"{e} (or null)") from None
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin in (list, tuple):
        if origin is list and not isinstance(value, list) and value is not None:
            value = [value]  # `data.train_files=a.parquet` means a one-file list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
            return tuple(convert(v, a, key) for v, a in zip(value, args))
        return [convert(v, args[0], key) for v in value]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        number = _number(value)
        if number is None or not float(number).is_integer():
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(number)
    if tp is float:
        number = _number(value)
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(number)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `tracking.experiment=2024` is a name, not a number
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported config type {tp} for {key}")


def _number(value: Any) -> int | float | None:
    """int/float, or a string YAML 1.1 leaves unparsed such as '1e-6'; None if not a finite number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return value
    return None
