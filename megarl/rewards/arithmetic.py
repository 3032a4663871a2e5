"""Reward of the `arithmetic` demo task: partial credit per correct character position."""
from __future__ import annotations


def arithmetic_score(response: str, ground_truth: str) -> float:
    """Fraction of positions where response and ground truth agree, over the longer of the two.

    Dividing by the longer length makes stopping on time part of the task without knowing the
    tokenizer's eos: "472" for "472" scores 1.0, "4725" 0.75, "47" 0.67, "" 0.0.
    Every character counts, whitespace included: "472 " scores 0.75, not 1.0. An earlier version
    stripped whitespace at both ends, so a response truncated at max_new_tokens after "472 " (a
    space where eos belongs) scored like "472" followed by eos; the CPU demo's GAE run learned to
    answer with a space and never stopped (greedy exact match 0.0). Only the full score now needs the
    exact answer, which (with max_new_tokens longer than the answer) means the response stopped.
    """
    length = max(len(response), len(ground_truth))
    if length == 0:
        return 1.0
    correct = sum(r == g for r, g in zip(response, ground_truth))
    return correct / length
