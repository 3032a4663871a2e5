"""The text a reward sees for a response: what the model produced, special tokens included.

Rule: the stop token that ended the response (its last token, when that is one of the stop ids,
e.g. eos) is dropped; every other token is decoded as its text, special tokens too. So a policy
that slips `<pad>` or `<bos>` into an answer is scored on "47<pad>2", not on a cleaned-up "472":
`skip_special_tokens=True` made such tokens invisible to the reward, and the CPU demo learned to
emit them instead of the digits (docs/algorithms.md, "What the reward sees").
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence


def response_text(tokenizer: Any, token_ids: Sequence[int], stop_token_ids: Iterable[int] = ()) -> str:
    """Decode one response for scoring: drop the final stop token, keep every other token's text."""
    ids = [int(t) for t in token_ids]
    if ids and ids[-1] in set(int(t) for t in stop_token_ids):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def check_token_ids(name: str, token_ids: Iterable[int], vocab_size: int) -> None:
    """A config's token ids must exist in the model's vocabulary; ValueError naming the key otherwise."""
    bad = sorted(int(t) for t in token_ids if not 0 <= int(t) < vocab_size)
    if bad:
        raise ValueError(f"{name}: token ids {bad} are outside the model's vocabulary (0 .. {vocab_size - 1}); "
                         f"use ids from the model's tokenizer")
