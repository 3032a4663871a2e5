"""GSM8K rule reward, after verl's `verl/utils/reward_score/gsm8k.py` (compute_score).

strict:   the answer is the last "#### <number>" in the response (tests the format too).
flexible: the answer is the last number anywhere in the response.
Unlike verl, answers are compared as numbers ("72.", "72.0" and "$72" all match "72"), so a
sentence-final period does not turn a right answer into a wrong one.
"""
from __future__ import annotations

import re

_CLIP_CHARS = 300  # regexes on very long responses are slow; the answer sits at the end
_STRICT = re.compile(r"#### (\-?[0-9\.\,\$]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_answer(response: str, method: str = "strict") -> str | None:
    """The response's final answer as text with ',' and '$' removed, or None if there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be strict or flexible, got {method!r}")
    response = response[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(response)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_NUMBER.findall(response)):
        if candidate.strip(".,") not in ("", "-"):
            return candidate.replace(",", "")
    return None


def _as_number(text: str) -> float | None:
    try:
        return float(text.rstrip("."))
    except ValueError:
        return None


def gsm8k_score(response: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    """score if the extracted answer equals the ground truth, format_score if wrong, 0 if none."""
    answer = extract_answer(response, method)
    if answer is None:
        return 0.0
    a, g = _as_number(answer), _as_number(ground_truth.replace(",", ""))
    correct = (a == g) if a is not None and g is not None else answer == ground_truth
    return score if correct else format_score
