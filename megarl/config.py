"""Typed run configuration: dataclasses, YAML loading, `key=value` overrides, validation.

YAML is only the serialisation of `Config`. Every knob is one dataclass field whose metadata
holds its help text and numeric range; docs/configuration.md is generated from them
(`python -m megarl.config --docs > docs/configuration.md`, kept in sync by a test).

    cfg = load_config("configs/tiny_cpu.yaml", ["actor.optim.lr=1e-3", "trainer.total_steps=5"])
    sizes = validate(cfg, world_size)   # layout arithmetic, before any process group exists

Every problem is a `ConfigError` (a `ValueError`) with a one-line message naming the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import operator
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml

from megarl import checkpoint_io


class ConfigError(ValueError):
    """A bad config file, key or value; the message is one line a user can act on."""


def knob(default: Any, help: str, **bounds: float) -> Any:
    """A config field: default, one-line help, optional numeric bounds (ge, gt, le, lt)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **bounds})
    return field(default=default, metadata={"help": help, **bounds})


def section(cls: type, help: str, **defaults: Any) -> Any:
    """A nested config section; `defaults` override the section class's own defaults here."""
    return field(default_factory=lambda: cls(**defaults), metadata={"help": help})


# --------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------

# Spelled out (config must not import torch); a test keeps them equal to megarl.algorithms'
# KL_KINDS_ALL (+ "full") and AGG_MODES.
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+", "full"]
ADV_ESTIMATORS_WITH_GROUPS = ("grpo", "rloo")  # baselines from the other samples of a prompt
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

@dataclass
class MakeTinyConfig:
    """Options of megarl.tools.make_tiny_model (same names as its keyword arguments)."""

    enable: bool = knob(False, "create a tiny random model at model.path when that directory does not exist (CPU demo)")
    arch: Literal["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"] = knob("llama", "model family")
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
    path: str = knob("", "Hugging Face model directory (config.json, tokenizer, safetensors) of the actor")
    dtype: Literal["float32", "bfloat16"] = knob("bfloat16", "parameter / compute dtype (optimizer state stays float32)")
    sequence_packing: bool = knob(True, "remove padding: pack each micro-batch's sequences into one row "
                                        "(Megatron thd format; verl's use_remove_padding); false = right-padded rows")
    make_tiny: MakeTinyConfig = section(MakeTinyConfig, "tiny random model for CPU demos")


@dataclass
class ParallelConfig:
    tp: int = knob(1, "tensor-parallel size of actor, critic and reference training", ge=1)
    pp: int = knob(1, "pipeline-parallel size", ge=1)
    ep: int = knob(1, "expert-parallel size (MoE models)", ge=1)
    etp: Optional[int] = knob(None, "expert tensor-parallel size; null = parallel.tp", ge=1)
    vpp: Optional[int] = knob(None, "virtual pipeline stages per pipeline rank (interleaved schedule); null = off", ge=1)
    cp: int = knob(1, "context-parallel size (long sequences)", ge=1)


@dataclass
class RolloutConfig:
    engine: Literal["hf", "vllm", "sglang"] = knob("hf", "inference engine that generates responses (hf runs on CPU)")
    tp: int = knob(1, "tensor-parallel size of the inference engine", ge=1)
    samples_per_prompt: int = knob(1, "responses sampled per prompt (GRPO/RLOO need >= 2)", ge=1)
    temperature: float = knob(1.0, "sampling temperature", gt=0)
    top_p: float = knob(1.0, "nucleus sampling mass", gt=0, le=1)
    top_k: int = knob(-1, "top-k sampling; -1 = off", ge=-1)
    max_new_tokens: int = knob(512, "response length limit, tokens", ge=1)
    stop_token_ids: list[int] = knob([], "extra token ids that end a response (eos always does)")
    gpu_memory_utilization: float = knob(0.5, "fraction of GPU memory the engine may take (vllm/sglang)", gt=0, le=1)
    bucket_bytes: int = knob(512 * 2**20, "bytes per bucket of the actor -> engine weight stream", ge=1)
    verify_weights: bool = knob(True, "after each weight sync, compare engine and actor log-probs and fail loudly")


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
    auto_prepare: Optional[Literal["arithmetic", "gsm8k"]] = knob(
        None, "write this dataset to train_files[0] (and val_files[0]) when train_files[0] is missing")
    gsm8k_source: Optional[str] = knob(None, "directory with GSM8K train.jsonl/test.jsonl for auto_prepare; null = ../shared/data/gsm8k")
    arithmetic: ArithmeticDataConfig = section(ArithmeticDataConfig, "the generated arithmetic demo task")


@dataclass
class OptimConfig:
    lr: float = knob(1e-6, "peak learning rate", gt=0)
    betas: tuple[float, float] = knob((0.9, 0.999), "Adam betas")
    weight_decay: float = knob(0.01, "decoupled weight decay", ge=0)
    eps: float = knob(1e-8, "Adam epsilon", gt=0)
    max_grad_norm: float = knob(1.0, "clip the global gradient norm to this", gt=0)
    warmup_steps: int = knob(0, "linear warmup, in trainer steps (the schedule advances once per PPO step, as in verl)", ge=0)
    schedule: Literal["constant", "cosine"] = knob("constant", "learning-rate schedule after warmup")
    min_lr: float = knob(0.0, "learning rate the cosine schedule reaches at trainer.total_steps", ge=0)


@dataclass
class ActorConfig:
    optim: OptimConfig = section(OptimConfig, "actor optimizer")
    ppo_epochs: int = knob(1, "passes over each step's responses", ge=1)
    ppo_mini_batches: int = knob(4, "optimizer steps per epoch: the step's responses are split into this many mini-batches", ge=1)
    max_tokens_per_microbatch: int = knob(16384, "tokens per forward/backward micro-batch, per DP rank", ge=1)
    clip_ratio: float = knob(0.2, "PPO ratio clip epsilon", gt=0)
    clip_ratio_low: Optional[float] = knob(None, "lower clip epsilon; null = clip_ratio", gt=0)
    clip_ratio_high: Optional[float] = knob(None, "upper clip epsilon (DAPO clip-higher); null = clip_ratio", gt=0)
    clip_ratio_c: float = knob(3.0, "dual-clip bound for negative advantages (Ye et al. 2020)", gt=1)
    loss_agg_mode: LossAggMode = knob("token-mean", "how token losses become the batch loss (normalised over the global batch)")
    entropy_coeff: float = knob(0.0, "entropy bonus coefficient", ge=0)
    use_kl_loss: bool = knob(False, "add a KL(actor || ref) loss term (GRPO style)")
    kl_loss_coef: float = knob(0.001, "coefficient of the KL loss", ge=0)
    kl_loss_type: KLKind = knob("low_var_kl", "KL estimator of the KL loss (a trailing + : straight-through k2 gradient)")
    policy_loss: Literal["ppo", "gspo"] = knob("ppo", "token-level PPO or sequence-level GSPO ratio")
    param_offload: bool = knob(False, "keep parameters on CPU outside the update")
    grad_offload: bool = knob(False, "keep gradients on CPU outside the update")
    optimizer_offload: bool = knob(False, "keep optimizer state on CPU outside the update")
    recompute: Literal["none", "selective", "full"] = knob("none", "activation recomputation granularity")


@dataclass
class CriticConfig:
    model_path: Optional[str] = knob(None, "HF directory to initialise the critic trunk from; null = model.path")
    optim: OptimConfig = section(OptimConfig, "critic optimizer", lr=1e-5)
    ppo_epochs: int = knob(1, "passes over each step's responses", ge=1)
    ppo_mini_batches: int = knob(4, "optimizer steps per epoch", ge=1)
    max_tokens_per_microbatch: int = knob(32768, "tokens per forward/backward micro-batch, per DP rank", ge=1)
    vf_clip: float = knob(0.5, "value clip range around the rollout values", gt=0)
    loss_agg_mode: LossAggMode = knob("token-mean", "how token value losses become the batch loss")
    param_offload: bool = knob(False, "keep parameters on CPU outside the update")
    grad_offload: bool = knob(False, "keep gradients on CPU outside the update")
    optimizer_offload: bool = knob(False, "keep optimizer state on CPU outside the update")
    recompute: Literal["none", "selective", "full"] = knob("none", "activation recomputation granularity")


@dataclass
class RefConfig:
    param_offload: bool = knob(False, "keep the reference model on CPU between its forward passes")


@dataclass
class RewardConfig:
    kind: Literal["auto", "gsm8k", "arithmetic", "function", "model"] = knob(
        "auto", "auto picks the rule by each row's data_source (gsm8k, arithmetic)")
    function: Optional[str] = knob(None, "'module:function' for kind=function, called like megarl.rewards.RewardFn")
    model_path: Optional[str] = knob(None, "reward model (HF directory with a scalar head) for kind=model")
    gsm8k_method: Literal["strict", "flexible"] = knob("strict", "strict: answer after '####'; flexible: last number")
    format_score: float = knob(0.0, "score of a well-formed but wrong answer")


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = knob("fixed", "fixed coefficient or adaptive (Ziegler et al. 2019)")
    kl_coef: float = knob(0.001, "(initial) KL coefficient", ge=0)
    target_kl: float = knob(0.1, "adaptive: KL the controller steers to", gt=0)
    horizon: int = knob(10000, "adaptive: controller horizon, in responses", ge=1)
    min_coef: float = knob(0.0, "lower bound of the coefficient", ge=0)
    max_coef: Optional[float] = knob(None, "upper bound of the coefficient; null = none", ge=0)


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


@dataclass
class GuardsConfig:
    kl_threshold: float = knob(0.0, "mean token KL(actor || ref) of a rollout above which kl_action fires; 0 = off", ge=0)
    kl_action: Literal["raise_coef", "skip_update"] = knob(
        "raise_coef", "double the KL coefficient (up to max_coef), or skip the actor update of that step")
    grad_norm_threshold: float = knob(0.0, "skip an optimizer step whose grad norm (before clipping) exceeds this; 0 = off", ge=0)
    nan_skip_and_restore: bool = knob(True, "skip a step with non-finite loss/grad norm; restore the last checkpoint after nan_patience in a row")
    nan_patience: int = knob(3, "consecutive non-finite steps before restoring", ge=1)
    reward_collapse_fraction: float = knob(
        0.0, "score below this fraction of its EMA: halve the LRs and roll back to the last checkpoint; 0 = off", ge=0, lt=1)
    reward_ema_steps: int = knob(10, "EMA window of the score, in steps (also the steps before the guard arms)", ge=1)


@dataclass
class TrackingConfig:
    mlflow: bool = knob(True, "log params and metrics to MLflow")
    tracking_uri: Optional[str] = knob(None, "MLflow tracking URI; null = a local store inside trainer.run_dir")
    experiment: str = knob("megarl", "MLflow experiment name")
    run_name: Optional[str] = knob(None, "MLflow run name; null = basename of trainer.run_dir")
    progress_bar: bool = knob(True, "console progress bar over steps with score, pg_loss and kl")


@dataclass
class TrainerConfig:
    run_dir: str = knob("runs/megarl", "checkpoints, metrics.jsonl, resolved config and the MLflow store go here")
    total_steps: int = knob(100, "PPO steps to run", ge=1)
    seed: int = knob(1, "seed of data order, sampling and init; randomness never depends on the layout", ge=0)
    save_every_steps: int = knob(0, "checkpoint every N steps (and at the end); 0 = never", ge=0)
    keep_last_checkpoints: int = knob(0, "delete older complete checkpoints beyond this many; 0 = keep all", ge=0)
    resume: str = knob("auto", "auto (latest complete checkpoint in run_dir, if any) | never | a checkpoint path")
    log_every: int = knob(1, "console log interval, steps (metrics.jsonl gets every step)", ge=1)
    val_every_steps: int = knob(0, "validate every N steps on data.val_files; 0 = never", ge=0)


@dataclass
class Config:
    model: ModelConfig = section(ModelConfig, "the actor model")
    parallel: ParallelConfig = section(ParallelConfig, "Megatron training layout")
    rollout: RolloutConfig = section(RolloutConfig, "response generation")
    data: DataConfig = section(DataConfig, "prompts")
    actor: ActorConfig = section(ActorConfig, "policy update")
    critic: CriticConfig = section(CriticConfig, "value model (adv_estimator=gae)")
    ref: RefConfig = section(RefConfig, "frozen reference policy")
    reward: RewardConfig = section(RewardConfig, "scoring of responses")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages and KL control")
    guards: GuardsConfig = section(GuardsConfig, "automatic reactions to unhealthy steps")
    tracking: TrackingConfig = section(TrackingConfig, "metrics")
    trainer: TrainerConfig = section(TrainerConfig, "run control")


# --------------------------------------------------------------------------------------------
# Loading: YAML -> dict, overrides, dict -> dataclasses with type checks
# --------------------------------------------------------------------------------------------

def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (None = all defaults), apply `key=value` overrides, check values."""
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of config sections, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    cfg = _build(Config, raw, "", Config())
    validate(cfg)
    return cfg


def apply_override(raw: dict, item: str) -> None:
    """Set one dotted `key=value` (value parsed as YAML: 1e-6, true, [a,b], null) in a raw dict."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. actor.optim.lr=1e-6)")
    _check_key(key)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text  # e.g. an unbalanced bracket in a path: keep it as the plain string
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: expected a mapping, got {child!r}")
        node = child
    node[parts[-1]] = value


def all_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema, e.g. 'actor.optim.lr'."""
    cls = cls or Config
    keys = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _check_key(key: str) -> None:
    cls = Config
    for part in key.split("."):
        if cls is None or part not in _hints(cls):
            raise _unknown_key(key)
        tp = _hints(cls)[part]
        cls = tp if dataclasses.is_dataclass(tp) else None


# verl spellings users bring along, mapped to ours (difflib would not find these).
_VERL_NAMES = {
    "rollout.n": "rollout.samples_per_prompt",
    "rollout.response_length": "rollout.max_new_tokens",
    "data.train_batch_size": "data.prompts_per_step",
    "data.max_prompt_length": "data.max_prompt_tokens",
    "data.max_response_length": "rollout.max_new_tokens",
    "actor.ppo_mini_batch_size": "actor.ppo_mini_batches",
    "actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_microbatch",
    "critic.cliprange_value": "critic.vf_clip",
    "model.use_remove_padding": "model.sequence_packing",
    "trainer.save_freq": "trainer.save_every_steps",
    "trainer.total_training_steps": "trainer.total_steps",
}


def _unknown_key(key: str) -> ConfigError:
    if key in _VERL_NAMES:
        return ConfigError(f"unknown config key '{key}' (a verl name); megarl's key is "
                           f"'{_VERL_NAMES[key]}', check its unit in docs/configuration.md")
    keys = all_keys()
    leaf = key.rsplit(".", 1)[-1]
    # A known leaf in the wrong place (trainer.gamma -> algorithm.gamma) beats spelling distance.
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    close = (difflib.get_close_matches(key, same_leaf, n=1, cutoff=0)
             or difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
             or difflib.get_close_matches(key, sorted({k.rsplit(".", 1)[0] for k in keys}), n=1, cutoff=0.6))
    hint = f"; did you mean '{close[0]}'?" if close else " (see docs/configuration.md)"
    return ConfigError(f"unknown config key '{key}'{hint}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a config class (this module uses postponed annotations)."""
    return typing.get_type_hints(cls)


def _build(cls: type, data: Any, prefix: str, base: Any) -> Any:
    """Make a `cls` from a mapping, starting from `base` (the parent's default for this section)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    for key in data:
        if key not in hints:
            raise _unknown_key(f"{prefix}{key}")
    values = {}
    for f in dataclasses.fields(cls):
        default = getattr(base, f.name)
        if f.name not in data:
            values[f.name] = default
        elif dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = _build(hints[f.name], data[f.name], f"{prefix}{f.name}.", default)
        else:
            values[f.name] = _convert(data[f.name], hints[f.name], f"{prefix}{f.name}")
    return cls(**values)


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check (and lightly coerce) one YAML value against its annotated type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        try:
            return _convert(value, inner, key)
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
            return tuple(_convert(v, a, key) for v, a in zip(value, args))
        return [_convert(v, args[0], key) for v in value]
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


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchSizes:
    """Sizes derived from the config and the world size; printed at start-up."""

    world_size: int
    dp: int
    prompts_per_dp_rank: int
    responses_per_step: int
    responses_per_dp_rank: int
    actor_responses_per_minibatch_per_dp_rank: int
    critic_responses_per_minibatch_per_dp_rank: int


def validate(cfg: Config, world_size: int | None = None) -> BatchSizes | None:
    """Check values (ranges, enums, cross-field rules); with `world_size`, also the layout arithmetic."""
    _check_bounds(cfg, "")
    a, alg, r = cfg.actor, cfg.algorithm, cfg.reward
    if not cfg.model.path:
        raise ConfigError("model.path is required (a Hugging Face model directory)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: give at least one Parquet file (launch/prepare_data.py)")
    if alg.adv_estimator in ADV_ESTIMATORS_WITH_GROUPS and cfg.rollout.samples_per_prompt < 2:
        raise ConfigError(f"algorithm.adv_estimator={alg.adv_estimator} needs rollout.samples_per_prompt >= 2 "
                          f"(its baseline is the other samples of the prompt), got {cfg.rollout.samples_per_prompt}")
    for name, optim in (("actor", a.optim), ("critic", cfg.critic.optim)):
        if optim.min_lr > optim.lr:
            raise ConfigError(f"{name}.optim.min_lr = {optim.min_lr} is above {name}.optim.lr = {optim.lr}")
        if not all(0 <= b < 1 for b in optim.betas):
            raise ConfigError(f"{name}.optim.betas must each be in [0, 1), got {list(optim.betas)}")
    if r.kind == "function" and (not r.function or r.function.count(":") != 1):
        raise ConfigError(f"reward.kind=function needs reward.function='module:function', got {r.function!r}")
    if r.kind == "model" and not r.model_path:
        raise ConfigError("reward.kind=model needs reward.model_path")
    if alg.kl_ctrl.max_coef is not None and alg.kl_ctrl.max_coef < alg.kl_ctrl.min_coef:
        raise ConfigError(f"algorithm.kl_ctrl.max_coef = {alg.kl_ctrl.max_coef} is below "
                          f"algorithm.kl_ctrl.min_coef = {alg.kl_ctrl.min_coef}")
    p = cfg.parallel
    # Accepted by ParallelDims, not yet by the engine's forward paths: refuse rather than run wrong.
    if p.cp != 1:
        raise ConfigError(f"parallel.cp = {p.cp}: context parallelism is not supported by the trainer yet; use parallel.cp=1")
    if p.vpp is not None and p.vpp > 1:
        raise ConfigError(f"parallel.vpp = {p.vpp}: interleaved pipeline schedules are not supported by the trainer yet; "
                          f"use parallel.vpp=null")
    resume = cfg.trainer.resume
    if resume not in ("auto", "never"):
        if not os.path.isdir(resume):
            raise ConfigError(f"trainer.resume: {resume!r} is neither auto, never nor an existing checkpoint directory")
        if not checkpoint_io.is_complete(resume):
            raise ConfigError(f"trainer.resume: {resume} has no {checkpoint_io.COMPLETE} marker (an interrupted save?)")
    if world_size is None:
        return None
    return _check_layout(cfg, world_size)


def _check_layout(cfg: Config, world_size: int) -> BatchSizes:
    p = cfg.parallel
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.tp * parallel.pp * parallel.cp "
                          f"= {p.tp} * {p.pp} * {p.cp} = {model_parallel}")
    dp = world_size // model_parallel
    etp = p.etp or p.tp
    expert_parallel = etp * p.ep * p.pp
    if world_size % expert_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by parallel.etp * parallel.ep * parallel.pp "
                          f"= {etp} * {p.ep} * {p.pp} = {expert_parallel}")
    if world_size % cfg.rollout.tp:
        raise ConfigError(f"world size {world_size} is not divisible by rollout.tp = {cfg.rollout.tp}")
    prompts, n = cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt
    if prompts % dp:
        raise ConfigError(f"data.prompts_per_step = {prompts} is not divisible by the data-parallel size {dp} "
                          f"(world size {world_size} / (tp * pp * cp = {model_parallel}))")
    responses = prompts * n
    per_minibatch = {}
    roles = ("actor", "critic") if cfg.algorithm.adv_estimator == "gae" else ("actor",)
    for role in ("actor", "critic"):
        mini = getattr(cfg, role).ppo_mini_batches
        if role in roles and responses % (dp * mini):
            raise ConfigError(
                f"data.prompts_per_step * rollout.samples_per_prompt = {prompts} * {n} = {responses} responses per step "
                f"is not divisible by DP size * {role}.ppo_mini_batches = {dp} * {mini} = {dp * mini}")
        per_minibatch[role] = responses // (dp * mini)
    return BatchSizes(world_size=world_size, dp=dp, prompts_per_dp_rank=prompts // dp, responses_per_step=responses,
                      responses_per_dp_rank=responses // dp,
                      actor_responses_per_minibatch_per_dp_rank=per_minibatch["actor"],
                      critic_responses_per_minibatch_per_dp_rank=per_minibatch["critic"])


def _check_bounds(obj: Any, prefix: str) -> None:
    """Re-check types and enums (a Config built in code gets them too) and each field's bounds."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_bounds(value, key + ".")
            continue
        _convert(value, hints[f.name], key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        for bound, ok, word in (("ge", operator.ge, ">="), ("gt", operator.gt, ">"),
                                ("le", operator.le, "<="), ("lt", operator.lt, "<")):
            if bound in f.metadata and not ok(value, f.metadata[bound]):
                raise ConfigError(f"{key} must be {word} {f.metadata[bound]}, got {value}")


# --------------------------------------------------------------------------------------------
# Output: resolved YAML, flat params, docs
# --------------------------------------------------------------------------------------------

def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples become lists) that yaml.safe_dump can write."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def flatten(cfg: Config) -> dict[str, Any]:
    """{'actor.optim.lr': 1e-6, ...} for experiment trackers."""
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v
    walk(to_dict(cfg), "")
    return out


def save_resolved(cfg: Config, path: str | os.PathLike) -> None:
    """Write the fully resolved config as YAML (loadable by load_config)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("# Resolved megarl config: every key, after the config file and overrides.\n")
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False, default_flow_style=None)


_DOCS_INTRO = """\
# Configuration reference

Generated from `megarl/config.py` by `python -m megarl.config --docs > docs/configuration.md`;
a test fails when this file is out of date.

A run is one YAML file plus `key=value` overrides on the command line:

    torchrun --standalone --nproc_per_node 2 launch/ppo.py --config configs/tiny_cpu.yaml \\
        actor.optim.lr=5e-4 trainer.total_steps=20 data.train_files=[a.parquet,b.parquet]

Override values are parsed as YAML (`1e-6`, `true`, `[a,b]`, `null`). Before any process group or
model is built, the config is checked and every problem is one line naming the key: an unknown key
(with the closest valid one), a wrong type, a value out of range or not among the allowed values,
and the layout arithmetic for the world size (for example `world size 6 is not divisible by
parallel.tp * parallel.pp * parallel.cp = 2 * 2 * 1 = 4`). The resolved config is written to
`<trainer.run_dir>/config.yaml`.

Sizes say their unit and scope: `data.prompts_per_step` counts prompts of the whole step (all
data-parallel ranks); the step trains on `prompts_per_step * rollout.samples_per_prompt`
responses, split into `ppo_mini_batches` optimizer steps per epoch; `max_tokens_per_microbatch`
is per data-parallel rank. The data-parallel size is world size / (tp * pp * cp).

Metrics go to `<trainer.run_dir>/metrics.jsonl` and, by default, to an MLflow store in the run
directory: `mlflow ui --backend-store-uri sqlite:///<trainer.run_dir>/mlflow.db`.
"""


def render_docs() -> str:
    """Markdown reference of every key, generated from the schema."""
    lines = [_DOCS_INTRO]

    def emit(section_default, prefix, title, help):
        """One table per section; defaults come from the parent's default (critic lr 1e-5)."""
        cls = type(section_default)
        lines.extend([f"## `{title}`", "", help[:1].upper() + help[1:] + ".", "",
                      "| key | type | default | description |", "|---|---|---|---|"])
        nested = []
        for f in dataclasses.fields(cls):
            tp, default = _hints(cls)[f.name], getattr(section_default, f.name)
            if dataclasses.is_dataclass(tp):
                nested.append((default, f"{prefix}{f.name}", f.metadata["help"]))
                continue
            bounds = [f"{w} {f.metadata[b]}" for b, w in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                      if b in f.metadata]
            kind = ", ".join([_type_name(tp)] + bounds)
            help_text = f.metadata["help"].replace("|", "\\|")
            lines.append(f"| `{prefix}{f.name}` | {kind} | `{_yaml_scalar(default)}` | {help_text} |")
        lines.append("")
        for default, name, help in nested:
            emit(default, name + ".", name, help)

    defaults = Config()
    for f in dataclasses.fields(Config):
        emit(getattr(defaults, f.name), f"{f.name}.", f.name, f.metadata["help"])
    return "\n".join(lines)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _type_name(next(a for a in args if a is not type(None))) + " or null"
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}"
    return {bool: "bool", int: "int", float: "float", str: "str"}[tp]


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, tuple):
        v = list(v)
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


if __name__ == "__main__":
    if sys.argv[1:] == ["--docs"]:
        print(render_docs())
    else:
        print("usage: python -m megarl.config --docs > docs/configuration.md", file=sys.stderr)
        sys.exit(2)
