"""The tool demo's table and its prompt rows (megarl.agents.lookup: the environment that answers a
lookup; configs/tiny_cpu_tool.yaml; `data.auto_prepare=lookup` writes the rows). The table is a keyed
hash of the key: a held-out key's value cannot be learned from the training keys, and the two sets of
keys are disjoint (`is_held_out`)."""
from __future__ import annotations

import hashlib
import random

_SALT = b"megarl-lookup-v1"
HELD_OUT_EVERY = 5  # one key in five (by hash) is held out for validation


def _hash(key: str, what: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, key=_SALT, person=what).digest(), "little")


def secret_value(key: str) -> str:
    """The table's value of `key`: as many digits as the key."""
    return str(_hash(key, b"value") % 10 ** len(key)).zfill(len(key))


def is_held_out(key: str) -> bool:
    return _hash(key, b"split") % HELD_OUT_EVERY == 0


def lookup_rows(count: int, split: str, num_digits: int = 3) -> list[dict]:
    """`count` rows of the task; split "train" draws training keys, "test" held-out keys only."""
    keys = [str(k).zfill(num_digits) for k in range(10 ** num_digits)]
    keys = [k for k in keys if is_held_out(k) == (split != "train")]
    rng = random.Random(f"lookup:{num_digits}:{split}")
    rows = []
    for i in range(count):
        key = rng.choice(keys)
        rows.append({"prompt": f"{key}=", "ground_truth": secret_value(key), "data_source": "lookup",
                     "extra": {"index": i, "split": split}})
    return rows
