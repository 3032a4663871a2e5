"""Write a prompt dataset as Parquet (prompt, ground_truth, data_source, extra).

    python launch/prepare_data.py gsm8k --out data/gsm8k [--input ../shared/data/gsm8k]
    python launch/prepare_data.py arithmetic --out data/arithmetic [--kind copy --num-digits 3]

The supervised stages' formats (docs/sft_rm.md), from JSONL or from the demo task:

    python launch/prepare_data.py sft --out data/my_sft --input my_sft.jsonl
    python launch/prepare_data.py preference --out data/my_pairs --input my_pairs.jsonl
    python launch/prepare_data.py sft --out data/arith_sft --arithmetic [--train-size 4000 --train-offset 0]
    python launch/prepare_data.py preference --out data/arith_pairs --arithmetic [--train-offset 4000]

sft JSONL records: {"prompt", "response"}, {"messages": [{"role", "content"}, ...]} (the last message the
assistant's answer) or a prompt dataset's {"prompt", "ground_truth"}; preference records: {"prompt",
"chosen", "rejected"}. --arithmetic writes the demo task instead: SFT rows answer each prompt, preference
pairs set its answer against a wrong one (megarl.data.prepare.wrong_answer).

gsm8k reads train.jsonl / test.jsonl ({"question", "answer" ending in "#### <number>"}) from
--input (a directory or one .jsonl file; default ../shared/data/gsm8k next to the repository).
Every dataset writes <out>/train.parquet and <out>/test.parquet (test when the input has one).
"""
from __future__ import annotations

import argparse
import sys

from megarl.data.arithmetic import TASK_KINDS
from megarl.data.prepare import prepare_arithmetic, prepare_arithmetic_formats, prepare_gsm8k, prepare_jsonl_format


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
    for fmt, what in (("sft", "SFT rows (prompt, response)"), ("preference", "preference pairs (prompt, chosen, rejected)")):
        stage = sub.add_parser(fmt, help=f"{what} from JSONL (--input) or the demo task (--arithmetic)")
        stage.add_argument("--out", required=True, help="output directory")
        source = stage.add_mutually_exclusive_group(required=True)
        source.add_argument("--input", help="a .jsonl file (the train split) or a directory with train.jsonl / test.jsonl")
        source.add_argument("--arithmetic", action="store_true", help="the generated demo task")
        stage.add_argument("--kind", default="copy", choices=TASK_KINDS)
        stage.add_argument("--num-digits", type=int, default=3)
        stage.add_argument("--train-size", type=int, default=4000)
        stage.add_argument("--val-size", type=int, default=256)
        stage.add_argument("--train-offset", type=int, default=0, help="index of the first training row in the task")
    args = parser.parse_args(argv)
    try:
        if args.dataset in ("sft", "preference"):
            written = (prepare_arithmetic_formats(args.out, args.dataset, args.kind, args.num_digits, args.train_size,
                                                  args.val_size, args.train_offset) if args.arithmetic
                       else prepare_jsonl_format(args.out, args.dataset, args.input))
        elif args.dataset == "gsm8k":
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
