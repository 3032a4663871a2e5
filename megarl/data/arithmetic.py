"""The `arithmetic` demo task: digit strings a tiny random model can learn from scratch.

Sized with a plain-torch prototype (docs/operations.md, "How the CPU demo was sized"): a 2-layer random
Llama with a character vocabulary learns `copy` in a few dozen PPO steps, while true arithmetic
("(a+b) mod 10") does not move in 300 steps. The prompts use only characters of the tiny
`digits` tokenizer: 0-9, `+`, `=`, `;` and space.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

TASK_KINDS = ("copy", "repeat", "add")


@dataclass(frozen=True)
class ArithmeticTask:
    """Deterministic prompt generator: row i depends only on (kind, num_digits, i).

    kind:
      copy    "472=" -> "472"   (copy the digits; needs positional attention, one token each)
      repeat  "4;3=" -> "444"   (repeat the first digit k times)
      add     "12+34=" -> "46"  (integer addition; too hard for the from-scratch demo)
    """

    kind: str = "copy"
    num_digits: int = 3

    def __post_init__(self):
        if self.kind not in TASK_KINDS:
            raise ValueError(f"arithmetic task kind {self.kind!r} is not one of {', '.join(TASK_KINDS)}")
        if not 1 <= self.num_digits <= 9:
            raise ValueError(f"arithmetic num_digits must be in [1, 9], got {self.num_digits}")

    def sample(self, index: int) -> dict:
        """Row `index`: {'prompt', 'ground_truth', 'data_source', 'extra'}."""
        rng = random.Random(f"{self.kind}:{self.num_digits}:{index}")
        digits = "".join(rng.choice("0123456789") for _ in range(self.num_digits))
        if self.kind == "copy":
            prompt, truth = f"{digits}=", digits
        elif self.kind == "repeat":
            prompt, truth = f"{digits[0]};{self.num_digits}=", digits[0] * self.num_digits
        else:
            a = int(digits)
            b = int("".join(rng.choice("0123456789") for _ in range(self.num_digits)))
            prompt, truth = f"{a}+{b}=", str(a + b)
        return {"prompt": prompt, "ground_truth": truth, "data_source": f"arithmetic/{self.kind}",
                "extra": {"index": index, "kind": self.kind, "num_digits": self.num_digits}}
