"""Write a prompt dataset as Parquet (prompt, ground_truth, data_source, extra).

    python launch/prepare_data.py gsm8k --out data/gsm8k [--input ../shared/data/gsm8k]
    python launch/prepare_data.py arithmetic --out data/arithmetic [--kind copy --num-digits 3]

gsm8k reads train.jsonl / test.jsonl ({"question", "answer" ending in "#### <number>"}) from
--input (a directory or one .jsonl file; default ../shared/data/gsm8k next to the repository).
Both write <out>/train.parquet and <out>/test.parquet.
"""
from __future__ import annotations

import argparse
import sys

from megarl.data.arithmetic import TASK_KINDS
from megarl.data.prepare import prepare_arithmetic, prepare_gsm8k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="dataset", required=True)
    gsm8k = sub.add_parser("gsm8k", help="GSM8K from JSONL")
    gsm8k.add_argument("--out", required=True, help="output directory")
    gsm8k.add_argument("--input", default=None, help="directory with train.jsonl/test.jsonl, or one .jsonl")
    arith = sub.add_parser("arithmetic", help="the generated demo task")
    arith.add_argument("--out", required=True, help="output directory")
    arith.add_argument("--kind", default="copy", choices=TASK_KINDS)
    arith.add_argument("--num-digits", type=int, default=3)
    arith.add_argument("--train-size", type=int, default=20000)
    arith.add_argument("--val-size", type=int, default=512)
    args = parser.parse_args(argv)
    try:
        if args.dataset == "gsm8k":
            written = prepare_gsm8k(args.out, args.input)
        else:
            written = prepare_arithmetic(args.out, args.kind, args.num_digits, args.train_size, args.val_size)
    except (ValueError, OSError) as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    for split, path in written.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
