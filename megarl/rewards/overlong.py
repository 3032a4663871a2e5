"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), as verl computes it
(`verl/workers/reward_manager/dapo.py`):

    expected_len = L_max - L_buf
    penalty      = min(-(len - expected_len) / L_buf * penalty_factor, 0)

with L_max = rollout.max_new_tokens, L_buf = reward.overlong_buffer.len and len the response's
token count including its stop token (verl's valid_response_length, the response mask's sum).
So: 0 up to and including len = L_max - L_buf; linear in between; -penalty_factor at len = L_max.
Responses never exceed L_max here (the engines stop there), but a longer one is held at
-penalty_factor, the paper's value beyond the limit.
"""
from __future__ import annotations


def overlong_penalty(response_len: int, max_len: int, buffer_len: int, penalty_factor: float) -> float:
    """The (<= 0) score added to a response of `response_len` tokens; 0.0 when buffer_len is 0 (off)."""
    if buffer_len <= 0:
        return 0.0
    exceed = min(response_len, max_len) - (max_len - buffer_len)
    return -exceed / buffer_len * penalty_factor if exceed > 0 else 0.0
