"""Weights in and out of a sharded Megatron-Core model.

- `load_hf_weights`: each rank reads only the slices of the safetensors files that its own shard
  needs (safetensors `get_slice`), never the full model.
- `export_hf`: a stream of `(hf_name, full tensor)`, one tensor at a time, identical on every rank:
  TP shards are all-gathered inside the owning stage, then broadcast from that stage. Used for HF
  checkpoints and rollout-engine weight loading.
- `local_weight_shards`: this rank's parameters under global names with their `ShardMeta`, the
  input of the 3D-HybridEngine.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Iterator, Sequence

from safetensors import safe_open
from safetensors.torch import save_file
import torch
import torch.distributed as dist

from megarl.models.convert import WeightMapping, exported_mappings, mtp_tensor_names, read_shard, to_hf, weight_mappings
from megarl.models.families import ModelSpec
from megarl.models.sharding import ShardMeta
from megarl.distributed.parallel import ParallelDims

logger = logging.getLogger(__name__)

# Transformer-Engine layer specs fuse the norms into the following linear layer.
_TE_TO_LOCAL = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
    # multi-latent attention: the latent norms fuse into the up projections
    (re.compile(r"self_attention\.linear_q_up_proj\.layer_norm_weight$"), "self_attention.q_layernorm.weight"),
    (re.compile(r"self_attention\.linear_kv_up_proj\.layer_norm_weight$"), "self_attention.kv_layernorm.weight"),
)
# Checkpoint tensors that are module buffers, not parameters: the sigmoid router's score-correction
# bias (DeepSeek-V3, GLM-4.5), frozen, but loaded, synced to the rollout engine and exported.
_WEIGHT_BUFFER = re.compile(r"\.mlp\.router\.expert_bias$")
# A rank's model: one module, or its chunks (one per virtual pipeline stage), wrapped or not.
Chunks = torch.nn.Module | list[torch.nn.Module]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def model_chunks(model) -> list[torch.nn.Module]:
    """The unwrapped model chunks of this rank: a list (one per virtual pipeline stage) or one model."""
    return [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]


def _layer_offset(model) -> int:
    # deferred: megatron (seconds to import) loads only when this runs
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, getattr(model, "vp_stage", None))


def global_name(local: str, layer_offset: int, expert_offset: int) -> str:
    """Local parameter name (per stage / per EP rank, local or TE spec) -> global canonical name."""
    name = local
    for pattern, replacement in _TE_TO_LOCAL:
        if pattern.search(name):
            layer = _LAYER.match(name).group(0)
            name = layer + replacement
    match = _LAYER.match(name)
    if match:
        name = f"decoder.layers.{int(match.group(1)) + layer_offset}." + name[match.end():]
    match = _EXPERT.search(name)
    if match:
        name = name[: match.start()] + f".mlp.experts.local_experts.{int(match.group(1)) + expert_offset}." + name[match.end():]
    return name


def _is_value_head(model: torch.nn.Module, local: str) -> bool:
    # Asked of the module rather than by isinstance: megarl.models.critic imports this module.
    return local.startswith("output_layer.") and getattr(getattr(model, "output_layer", None), "is_value_head", False)


def named_global_parameters(model, spec: ModelSpec, dims: ParallelDims) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(global name, local name, parameter) for every HF-mapped parameter of this rank's model
    chunk(s) (a critic's value head is not an HF weight and is left out), then the HF-mapped
    buffers (the router's expert bias). Each chunk numbers its layers from 0; Megatron's offset of
    the chunk (uneven stages, virtual stages) makes them global."""
    experts_per_rank = (spec.num_experts // dims.ep) if spec.is_moe else 0
    for chunk in model_chunks(model):
        offset = _layer_offset(chunk)
        for local, param in chunk.named_parameters():
            if not _is_value_head(chunk, local):
                yield global_name(local, offset, dims.ep_rank * experts_per_rank), local, param
        for local, buffer in chunk.named_buffers():
            if _WEIGHT_BUFFER.search(local):
                yield global_name(local, offset, dims.ep_rank * experts_per_rank), local, buffer


def _tp_coords(mapping: WeightMapping, dims: ParallelDims) -> tuple[int, int]:
    if mapping.expert is not None:
        return dims.etp_rank, dims.expert_tp
    return dims.tp_rank, dims.tp


def local_weight_shards(model: Chunks, spec: ModelSpec, dims: ParallelDims) -> dict[str, tuple[torch.Tensor, ShardMeta]]:
    """This rank's weights under global names, each with how it relates to the full tensor."""
    mappings = {m.name: m for m in weight_mappings(spec, dims.tp)}
    out = {}
    for name, _, param in named_global_parameters(model, spec, dims):
        if name not in mappings:  # e.g. a critic's value head
            continue
        mapping = mappings[name]
        out[name] = (param.data, mapping.meta(*_tp_coords(mapping, dims)))
    return out


# --- loading -------------------------------------------------------------------------------------------


def _open_safetensors(safe_open, path: Path):
    """safe_open, with a truncated or corrupt file reported as one ValueError naming it and the fix."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is listed in the model's weight index but does not exist; "
                                f"copy the complete model directory again")
    try:
        return safe_open(path, "pt")
    except Exception as e:  # safetensors raises its own SafetensorError (not an OSError) on a bad header
        raise ValueError(f"{path} is truncated or not a safetensors file ({' '.join(str(e).split())}); "
                         f"copy or download the model again (an interrupted transfer leaves such files)") from None


class SafetensorsDir:
    """Lazy, slice-level access to the safetensors files of an HF model directory."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            with _open_safetensors(safe_open, self.dir / "model.safetensors") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir} has no model.safetensors or model.safetensors.index.json")
        self.weight_map = weight_map
        self._open = {}
        self._safe_open = safe_open

    def _file(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"{self.dir} has no tensor named {name!r}; the checkpoint does not match its config.json")
        fname = self.weight_map[name]
        if fname not in self._open:
            self._open[fname] = _open_safetensors(self._safe_open, self.dir / fname)
        return self._open[fname]

    def read(self, name: str, rows: slice, cols: slice | None = None) -> torch.Tensor:
        view = self._file(name).get_slice(name)
        return view[rows] if cols is None else view[rows, cols]

    def full(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)


@torch.no_grad()
def load_hf_weights(model: Chunks, spec: ModelSpec, dims: ParallelDims, model_dir: str | Path) -> int:
    """Fill this rank's parameters from an HF checkpoint; returns the bytes this rank read."""
    source = SafetensorsDir(model_dir)
    mappings = {m.name: m for m in weight_mappings(spec, dims.tp)}
    mtp = mtp_tensor_names(spec, source.weight_map)
    if mtp and dims.rank == 0:
        layers = sorted({int(n.split(".")[2]) for n in mtp})
        logger.warning("%s: skipping %d multi-token-prediction layer(s) of the checkpoint (model.layers.%s, %d tensors): "
                       "megarl trains the causal LM only; they are not loaded and not exported",
                       model_dir, len(layers), ",".join(map(str, layers)), len(mtp))
    bytes_read = 0
    unmapped = []
    for name, local, param in named_global_parameters(model, spec, dims):
        if name not in mappings:  # would keep its random init: a naming drift, never skipped silently
            unmapped.append(local)
            continue
        mapping = mappings[name]
        shard = read_shard(mapping, *_tp_coords(mapping, dims), source.read, param.dtype)
        if shard.shape != param.shape:
            raise ValueError(f"{local}: checkpoint shard has shape {tuple(shard.shape)}, the model expects {tuple(param.shape)}")
        param.copy_(shard)
        bytes_read += shard.numel() * shard.element_size()
    if unmapped:
        raise ValueError(f"{len(unmapped)} parameter(s) of the {spec.family} model have no checkpoint mapping and would keep "
                         f"random weights: {', '.join(unmapped[:6])}{' ...' if len(unmapped) > 6 else ''}. The family's names in "
                         "megarl.models.convert.weight_mappings do not cover them (only a critic's value head is exempt)")
    return bytes_read


# --- export ----------------------------------------------------------------------------------------------


def _owner_stage(mapping: WeightMapping, spec: ModelSpec, dims: ParallelDims) -> int:
    if mapping.layer is not None:
        return dims.layer_owner(mapping.layer, spec.num_layers)[0]  # uneven and virtual stages included
    return 0 if mapping.name.startswith("embedding.") else dims.pp - 1


def _owner_ep(mapping: WeightMapping, spec: ModelSpec, dims: ParallelDims) -> int:
    return 0 if mapping.expert is None else mapping.expert // (spec.num_experts // dims.ep)


@torch.no_grad()
def export_canonical(model: Chunks, spec: ModelSpec, dims: ParallelDims, mappings: list[WeightMapping] | None = None,
                     overrides: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[WeightMapping, torch.Tensor]]:
    """Full canonical tensors, one at a time, identical on every rank (collective: all ranks iterate).
    overrides: global name -> this rank's shard to export instead of the parameter (LoRA's merged weights)."""
    mappings = mappings if mappings is not None else exported_mappings(spec, dims.tp)
    local = {name: param for name, _, param in named_global_parameters(model, spec, dims)}
    local.update(overrides or {})
    coords = dims.all_coordinates()
    dtype = next(model_chunks(model)[0].parameters()).dtype
    device = next(model_chunks(model)[0].parameters()).device
    for mapping in mappings:
        stage, ep_owner = _owner_stage(mapping, spec, dims), _owner_ep(mapping, spec, dims)
        is_expert = mapping.expert is not None
        owners = [c for c in coords if c["pp"] == stage and (not is_expert or c["ep"] == ep_owner)]
        src = min(c["rank"] for c in owners if (c["etp"] if is_expert else c["tp"]) == 0)
        if dims.pp_rank == stage and (not is_expert or dims.ep_rank == ep_owner):
            shard = local[mapping.name]
            tp_rank, tp_size = _tp_coords(mapping, dims)
            if mapping.tp_dim is not None and tp_size > 1:
                group = dims.etp_group if is_expert else dims.tp_group
                shards = [torch.empty_like(shard) for _ in range(tp_size)]
                dist.all_gather(shards, shard.contiguous(), group=group)
                full = mapping.meta(tp_rank, tp_size).full_from_shards(shards)
            else:
                full = shard.detach().clone()
        else:
            full = torch.empty(mapping.shape, dtype=torch.float32 if mapping.float32 else dtype, device=device)
        if dims.world_size > 1:
            dist.broadcast(full, src=src)
        yield mapping, full


def export_hf(model: Chunks, spec: ModelSpec, dims: ParallelDims, critic: bool = False,
              overrides: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every weight of the HF checkpoint, streamed, on every rank.

    A critic exports its backbone plus the value head as `score.weight` / `score.bias` (the names
    of HF's `*ForSequenceClassification` heads), which `megarl.models.critic` loads back.
    """
    for mapping, full in export_canonical(model, spec, dims, exported_mappings(spec, dims.tp, lm_head=not critic), overrides):
        yield from to_hf(mapping, full)
    if critic:
        yield from _value_head(model, dims)


def _value_head(model, dims: ParallelDims) -> Iterator[tuple[str, torch.Tensor]]:
    model = model_chunks(model)[-1]  # the head is on the last chunk
    param = next(model.parameters())
    for name in ("weight", "bias"):
        if dims.is_last_stage:
            t = getattr(model.output_layer, name).detach().clone()
        else:
            shape = (1, model.config.hidden_size) if name == "weight" else (1,)
            t = torch.empty(shape, dtype=param.dtype, device=param.device)
        if dims.world_size > 1:
            src = dims.all_coordinates()  # cheap at export time; picks the last stage's rank
            dist.broadcast(t, src=min(c["rank"] for c in src if c["pp"] == dims.pp - 1))
        if name == "bias" and not t.any():  # a reward model's (kept 0): transformers' head has none, megarl reads 0
            continue
        yield f"score.{name}", t


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_hf_checkpoint(model: Chunks, spec: ModelSpec, dims: ParallelDims, out_dir: str | Path, source_dir: str | Path,
                       max_shard_bytes: int = 2 << 30, critic: bool = False, banned_token_ids: Sequence[int] = (),
                       overrides: dict[str, torch.Tensor] | None = None) -> None:
    """Write an HF model directory (safetensors shards + config + tokenizer) from rank 0 (collective).
    banned_token_ids: the run's rollout.banned_token_ids, written as generation_config.json's
    suppress_tokens (`write_suppress_tokens`) so that `generate` samples the policy that was trained."""
    out_dir = Path(out_dir)
    write = dims.rank == 0
    if write:
        out_dir.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total_bytes, files, weight_map = 0, 0, [], {}

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
            # safetensors writes 0600; an exported model is meant to be read by others (serving,
            # evaluation jobs): the mode every other file gets, 0644 under the usual umask 022
            os.chmod(out_dir / fname, 0o666 & ~_umask())
            files.append(fname)
            weight_map.update({k: fname for k in shard})
        shard, shard_bytes = {}, 0

    for name, tensor in export_hf(model, spec, dims, critic=critic, overrides=overrides):
        if not write:
            continue
        shard[name] = tensor.cpu().contiguous()
        shard_bytes += tensor.numel() * tensor.element_size()
        total_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= max_shard_bytes:
            flush()
    if write:
        flush()
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        source_dir = Path(source_dir)
        for path in source_dir.iterdir():
            if path.is_file() and not path.name.startswith("model") and path.suffix in (".json", ".txt", ".model", ".jinja"):
                shutil.copy2(path, out_dir / path.name)
        if banned_token_ids and not critic:
            write_suppress_tokens(out_dir, banned_token_ids)
        if critic:
            write_sequence_classification_config(out_dir)


def write_sequence_classification_config(hf_dir: str | Path) -> None:
    """Make a scalar-head export's config.json that of a transformers `*ForSequenceClassification` with
    num_labels 1 (what `AutoModelForSequenceClassification` and `reward.model_path` read).

    The architecture is the source's with `ForCausalLM` replaced; pad_token_id is set when the source had
    none (to eos): transformers scores each row's last token that is not padding, and refuses a batch
    of several rows without a pad id. transformers' scalar head has no bias: `score.bias` stays in the
    files for megarl, and the reward-model trainer keeps it 0 (its Bradley-Terry gradient is 0)."""
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [a.replace("ForCausalLM", "ForSequenceClassification") for a in config.get("architectures") or []]
    config["num_labels"] = 1
    config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    if config.get("pad_token_id") is None and config.get("eos_token_id") is not None:
        eos = config["eos_token_id"]
        config["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_suppress_tokens(hf_dir: str | Path, token_ids: Sequence[int]) -> None:
    """Set generation_config.json's suppress_tokens to `token_ids` (creating the file from config.json
    when the directory has none).

    A banned token is part of the trained policy: the engines sampled with its logit at -inf and
    the trainer's log-probs leave it out (docs/algorithms.md, "Banned tokens"). transformers'
    `generate` reads suppress_tokens and sets those logits to -inf, so a user's greedy decoding of
    the export is the run's; without it the never-trained logits of e.g. <pad> win (issue 21).
    The source's own suppress_tokens are replaced: the run's bans are the policy's definition.
    vLLM's server does not read this key (docs/rollout.md says what to pass it instead).
    """
    from transformers import AutoConfig, GenerationConfig  # deferred: transformers (seconds to import) loads only when this runs

    hf_dir = Path(hf_dir)
    if (hf_dir / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(hf_dir)
    else:  # what transformers would derive at load time: bos / eos / pad ids from config.json
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(hf_dir))
    generation.suppress_tokens = sorted({int(t) for t in token_ids})
    generation.save_pretrained(hf_dir)
