"""Reward of the `arithmetic` demo task: partial credit per correct character position."""
from __future__ import annotations


def arithmetic_score(response: str, ground_truth: str) -> float:
    """Fraction of positions where response and ground truth agree, over the longer of the two.

    Dividing by the longer length makes stopping on time part of the task without knowing the
    tokenizer's eos: "472" for "472" scores 1.0, "4725" 0.75, "47" 0.67, "" 0.0.
    Whitespace at either end is ignored (real tokenizers may emit a leading space).
    """
    response, ground_truth = response.strip(), ground_truth.strip()
    length = max(len(response), len(ground_truth))
    if length == 0:
        return 1.0
    correct = sum(r == g for r, g in zip(response, ground_truth))
    return correct / length
