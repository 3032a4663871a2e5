"""A synthetic Megatron-style model, sharded like Megatron would shard it (tests and benchmarks).

Names follow Megatron-Core's GPT layout (global layer and expert numbers). Column-parallel
weights split dim 0, row-parallel dim 1, gated fc1 has two sub-chunks [gate; up], layer norms
and the router are replicated. Layers go to pipeline stages in contiguous blocks; experts to
expert-parallel ranks in contiguous blocks.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from megarl.hybrid.layout import TrainLayout
from megarl.models.sharding import ShardMeta


@dataclass(frozen=True)
class SyntheticModel:
    num_layers: int = 4
    hidden: int = 64
    ffn_hidden: int = 128
    vocab: int = 256
    num_experts: int = 0  # 0 = dense MLP
    dtype: torch.dtype = torch.float32
    shared_expert: bool = False  # MoE: a shared expert beside the routed ones (TP-split, on every EP rank)

    def tensors(self) -> list[tuple[str, tuple[int, ...], int | None, int, int, int | None]]:
        """[(name, full_shape, tp_dim, sub_chunks, layer or -1 (first stage) / -2 (last), expert or None)]."""
        h, f, V = self.hidden, self.ffn_hidden, self.vocab
        out = [("embedding.word_embeddings.weight", (V, h), 0, 1, -1, None)]
        for layer in range(self.num_layers):
            p = f"decoder.layers.{layer}."
            out += [
                (p + "self_attention.linear_qkv.layer_norm_weight", (h,), None, 1, layer, None),
                (p + "self_attention.linear_qkv.weight", (3 * h, h), 0, 1, layer, None),
                (p + "self_attention.linear_qkv.bias", (3 * h,), 0, 1, layer, None),
                (p + "self_attention.linear_proj.weight", (h, h), 1, 1, layer, None),
                (p + "mlp.linear_fc1.layer_norm_weight" if not self.num_experts else p + "pre_mlp_layernorm.weight", (h,), None, 1, layer, None),
            ]
            if not self.num_experts:
                out += [(p + "mlp.linear_fc1.weight", (2 * f, h), 0, 2, layer, None), (p + "mlp.linear_fc2.weight", (h, f), 1, 1, layer, None)]
            else:
                out.append((p + "mlp.router.weight", (self.num_experts, h), None, 1, layer, None))
                if self.shared_expert:
                    q = p + "mlp.shared_experts."
                    out += [(q + "linear_fc1.weight", (2 * f, h), 0, 2, layer, None), (q + "linear_fc2.weight", (h, f), 1, 1, layer, None)]
                for e in range(self.num_experts):
                    q = p + f"mlp.experts.local_experts.{e}."
                    out += [(q + "linear_fc1.weight", (2 * f, h), 0, 2, layer, e), (q + "linear_fc2.weight", (h, f), 1, 1, layer, e)]
        out += [("decoder.final_layernorm.weight", (h,), None, 1, -2, None), ("output_layer.weight", (V, h), 0, 1, -2, None)]
        return out

    @property
    def nbytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        n = 0
        for _, shape, *_ in self.tensors():
            k = 1
            for d in shape:
                k *= d
            n += k * item
        return n


def full_tensor(name: str, shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A deterministic random tensor per (name, seed), identical on every rank."""
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def stage_of(layer: int, num_layers: int, pp: int) -> int:
    if layer == -1:
        return 0
    if layer == -2:
        return pp - 1
    if num_layers % pp:
        raise ValueError(f"num_layers {num_layers} is not divisible by pp {pp}")
    return layer // (num_layers // pp)


def synthetic_shards(model: SyntheticModel, train: TrainLayout, rank: int, seed: int = 0, keep_full: bool = False):
    """This rank's local_shards (and, if keep_full, every full tensor for checking)."""
    c = train.coords(rank)
    if model.num_experts % train.ep:
        raise ValueError(f"num_experts {model.num_experts} is not divisible by ep {train.ep}")
    per_ep = model.num_experts // train.ep if model.num_experts else 0
    local: dict[str, tuple[torch.Tensor, ShardMeta]] = {}
    full: dict[str, torch.Tensor] = {}
    for name, shape, tp_dim, sub, layer, expert in model.tensors():
        if stage_of(layer, model.num_layers, train.pp) != c.pp:
            if keep_full:
                full[name] = full_tensor(name, shape, model.dtype, seed)
            continue
        if expert is not None and expert // per_ep != c.ep:
            if keep_full:
                full[name] = full_tensor(name, shape, model.dtype, seed)
            continue
        t = full_tensor(name, shape, model.dtype, seed)
        meta = ShardMeta(full_shape=shape, tp_dim=tp_dim, tp_rank=c.tp if tp_dim is not None else 0,
                         tp_size=train.tp if tp_dim is not None else 1, tp_sub_chunks=sub)
        local[name] = (meta.slice_of_full(t).clone(), meta)
        if keep_full:
            full[name] = t
    return local, full
