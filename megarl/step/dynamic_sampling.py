"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2; verl's
`algorithm.filter_groups`): a group whose samples all score the same has zero advantage under
GRPO / RLOO and gives no gradient, so it is dropped, and further prompts are generated until
`data.prompts_per_step` groups with a score spread remain.

Round k (0-based) takes the data's next step of prompts and renumbers prompt g of it
k * prompts_per_step + g, so sampling seeds (seed, step, prompt, sample) are new in every round
and do not depend on the layout. After each round the DP ranks share which of their groups have a
spread; once at least prompts_per_step have one, the first prompts_per_step of them in that global
order are trained, DP rank r taking the r-th contiguous block, renumbered 0 .. prompts_per_step - 1.
Groups that a rank generated but another rank trains travel to it (one object all-gather over the
DP group, of those groups only). So every layout trains the same groups in the same order, as one
process does. `algorithm.filter_groups.max_num_gen_batches` rounds without enough groups end the
step with `NotEnoughGroups`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from megarl.data.dataset import PromptRow
from megarl.step.samples import Sample


class NotEnoughGroups(RuntimeError):
    """max_num_gen_batches rounds did not give prompts_per_step groups with a score spread."""


@dataclass
class FilteredRollout:
    samples: list[Sample]  # this DP rank's share of the trained groups, prompt-major, renumbered
    scores: list[float]  # the samples' scores (the reward function's, overlong penalty included)
    metrics: dict[str, float]  # identical on every rank


def has_spread(group_scores: list[float]) -> bool:
    """Whether a group's samples do not all score the same (exact comparison, as verl's std > 0)."""
    return max(group_scores) != min(group_scores)


def generate_filtered(next_prompts: Callable[[], list[PromptRow]], generate: Callable[[list[PromptRow]], list[Sample]],
                      score: Callable[[list[Sample]], list[float]], gather: Callable[[object], list], *,
                      prompts_per_step: int, samples_per_prompt: int, max_rounds: int, dp_rank: int,
                      dp_size: int) -> FilteredRollout:
    """Generate and score rounds until prompts_per_step groups have a score spread (see module doc).

    next_prompts: this rank's prompts of the data's next step (global indices 0 .. P-1);
    generate / score: the trainer's, prompt-major, samples_per_prompt per prompt;
    gather(obj): every DP rank's obj in rank order (collective over the DP group)."""
    P, n = prompts_per_step, samples_per_prompt
    candidates: dict[int, tuple[list[Sample], list[float]]] = {}  # this rank's groups with a spread, by round key
    kept_keys: list[int] = []  # every rank's, in global order
    generated = 0
    for round_index in range(max_rounds):
        prompts = [dataclasses.replace(p, global_index=round_index * P + p.global_index) for p in next_prompts()]
        samples = generate(prompts)
        scores = score(samples)
        assert len(samples) == len(prompts) * n == len(scores), (len(samples), len(prompts), n, len(scores))
        mine = []
        for j in range(len(prompts)):
            group, group_scores = samples[j * n:(j + 1) * n], scores[j * n:(j + 1) * n]
            if has_spread(group_scores):
                key = group[0].prompt_index
                candidates[key] = (group, group_scores)
                mine.append(key)
        kept_keys += sorted(k for keys in gather(mine) for k in keys)
        generated += P
        if len(kept_keys) >= P:
            break
    else:
        raise NotEnoughGroups(
            f"dynamic sampling: {max_rounds} generation rounds of {P} prompts gave {len(kept_keys)} groups whose samples "
            f"do not all score the same, fewer than data.prompts_per_step = {P}; raise "
            f"algorithm.filter_groups.max_num_gen_batches (now {max_rounds}), or check that the reward can tell this "
            f"policy's responses apart")
    trained = kept_keys[:P]
    per_rank = P // dp_size
    wanted = trained[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    moving = {k: candidates[k] for k in trained if k in candidates and k not in set(wanted)}
    if dp_size > 1:  # groups this rank generated for another rank's block, and theirs for this one
        for payload in gather(moving):
            candidates.update(payload)
    position = {k: i for i, k in enumerate(trained)}
    samples, scores = [], []
    for key in wanted:
        group, group_scores = candidates[key]
        prompt = dataclasses.replace(group[0].prompt, global_index=position[key])
        samples += [dataclasses.replace(s, prompt=prompt) for s in group]
        scores += group_scores
    rounds = generated // P
    metrics = {"train/num_gen_batches": float(rounds), "train/num_groups_kept": float(P),
               "train/num_groups_dropped": float(generated - len(kept_keys)),
               "train/num_groups_unused": float(len(kept_keys) - P)}
    return FilteredRollout(samples, scores, metrics)
