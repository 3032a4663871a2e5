"""Critic: the policy's backbone with a scalar value head in place of the LM head.

Head initialisation: if the HF directory holds a `score.weight` of shape [1, hidden] (a reward model
saved as `*ForSequenceClassification` / `*ForTokenClassification`, or a critic megarl exported),
the head starts from it; otherwise weight ~ N(0, (VALUE_HEAD_INIT_STD^2 / hidden)) drawn from a generator
seeded with 0 (the same on every rank and for every layout, so runs compare across layouts) and bias 0.
The final norm gives hidden states of about unit RMS per element, so the initial values have a
standard deviation of about VALUE_HEAD_INIT_STD (0.01): a critic that knows nothing predicts about
0, and the first advantages are the rewards, not noise. The scale TRL uses, N(0, 1/(hidden+1)),
gives values of standard deviation about 1 whatever the hidden size (measured on the CPU demo:
explained variance -69 to -81 at step 1, rewards about 0.04), and PPO's first steps then push the actor
with the critic's noise.

The head is replicated on every tensor-parallel rank: its input (the final hidden states) is
identical across the TP group, so its gradient is too, and Megatron counts replicated parameters
once in the gradient norm. Under sequence parallelism the final hidden states arrive split over the
TP group ([s/tp, b, h]); the head gathers them first (as the LM head's column-parallel linear does),
with a backward that keeps each rank's own slice of the gradient and sums nothing: every TP rank
computes the same value loss from the same gathered values, so each rank's gradient of the gathered
states is already the whole one.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from megarl.models.weights import SafetensorsDir

VALUE_HEAD_INIT_SEED = 0
VALUE_HEAD_INIT_STD = 0.01  # standard deviation of the initial values on unit-RMS hidden states


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] -> values [s, b, 1]; called as Megatron's output layer.

    Its parameters are named `weight` and `bias` like the LM head it replaces, because Megatron's
    checkpointing (`LanguageModule.sharded_state_dict`) looks up `output_layer.weight`.
    """

    is_value_head = True  # megarl.models.weights leaves it out of the HF weights (exported as score.*)

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            # deferred: megatron (seconds to import) loads only when this runs
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # [s/tp, b, h] -> [s, b, h]; backward: this rank's slice (module docstring)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def _checkpoint_head(model_dir: str | Path, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    try:
        source = SafetensorsDir(model_dir)
    except FileNotFoundError:
        return None
    if "score.weight" not in source.weight_map:
        return None
    weight = source.full("score.weight")
    if tuple(weight.shape) != (1, hidden):
        return None
    bias = source.full("score.bias") if "score.bias" in source.weight_map else None
    return weight, bias


@torch.no_grad()
def attach_value_head(model: torch.nn.Module, spec, model_dir: str | Path) -> None:
    """Replace the LM head of the last pipeline stage by a ValueHead (no-op on other stages)."""
    if not model.post_process:
        return
    if model.share_embeddings_and_output_weights:
        raise ValueError("build the critic with value_head=True so it does not tie the output layer to the embedding")
    param = next(model.parameters())
    head = ValueHead(spec.hidden_size, param.dtype, param.device, sequence_parallel=bool(model.config.sequence_parallel))
    loaded = _checkpoint_head(model_dir, spec.hidden_size)
    if loaded is not None:
        head.weight.copy_(loaded[0])
        head.bias.copy_(loaded[1] if loaded[1] is not None else torch.zeros(1))
    else:
        gen = torch.Generator().manual_seed(VALUE_HEAD_INIT_SEED)
        std = VALUE_HEAD_INIT_STD / math.sqrt(spec.hidden_size)
        head.weight.copy_(torch.randn(1, spec.hidden_size, generator=gen) * std)
        head.bias.zero_()
    model.output_layer = head
