"""Prompt data: Parquet files (launch/prepare_data.py writes them), the per-DP-rank dataset with a
resumable seeded order, the arithmetic demo task, and padding helpers."""
from megarl.data.arithmetic import TASK_KINDS, ArithmeticTask
from megarl.data.dataset import PromptDataset, PromptRow, encode_prompt, read_prompt_files
from megarl.data.prepare import prepare_arithmetic, prepare_gsm8k, prepare_if_missing, write_parquet

__all__ = ["TASK_KINDS", "ArithmeticTask", "PromptDataset", "PromptRow", "encode_prompt", "read_prompt_files",
           "prepare_arithmetic", "prepare_gsm8k", "prepare_if_missing", "write_parquet"]
