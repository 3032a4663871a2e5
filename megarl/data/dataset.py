"""Prompt dataset: Parquet rows, per-epoch seeded shuffle, per-DP-rank shards, resumable position.

Every rank reads the same files and computes the same epoch order from (seed, epoch); step s of
an epoch is the global batch order[s * prompts_per_step : (s + 1) * prompts_per_step], and DP
rank r takes the contiguous block r of it. Each row carries its global index in the step's
batch, so sampling seeds (seed, step, global index, sample) never depend on the layout, and
concatenating the ranks' blocks in rank order gives back the global batch.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
import os
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

Tokenizer = Any  # a transformers tokenizer, or any callable str -> list[int]


@dataclass
class PromptRow:
    """One prompt of a step, as one DP rank sees it."""

    global_index: int  # position in the step's global batch, 0 .. prompts_per_step - 1
    row: int  # index into the dataset (after dropping overlong prompts)
    prompt: str
    ground_truth: str
    data_source: str
    extra: dict = field(default_factory=dict)
    prompt_ids: list[int] | None = None  # when the dataset was given a tokenizer


def encode_prompt(tokenizer: Tokenizer, text: str, apply_chat_template: bool = False) -> list[int]:
    """Token ids of a prompt: chat template (as the user turn) or plain encoding with special tokens."""
    if apply_chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
    elif hasattr(tokenizer, "encode"):
        ids = tokenizer.encode(text)
    else:
        ids = tokenizer(text)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding from newer transformers
        ids = ids["input_ids"]
    return list(ids)


def data_file_problem(path: str) -> str | None:
    """Why `path` cannot be a data file (missing, a directory, unreadable), or None if it may be;
    phrased to follow "data file ..." (`data file not found: x.parquet`)."""
    if os.path.isdir(path):
        return f"{path} is a directory, not a Parquet file (list the .parquet files inside it)"
    if not os.path.exists(path):
        return f"not found: {path}"
    if not os.access(path, os.R_OK):
        return f"{path} is not readable by this user (check its permissions)"
    return None


def read_prompt_files(files: Sequence[str], prompt_key: str = "prompt",
                      ground_truth_key: str = "ground_truth") -> list[dict]:
    """All rows of the Parquet files, in file order; errors name the file and the column."""
    rows = []
    for path in files:
        problem = data_file_problem(str(path))
        if problem:
            raise ValueError(f"data file {problem}")
        try:
            table = pq.read_table(path)
        except FileNotFoundError:
            raise ValueError(f"data file not found: {path}") from None
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"data file {path} is not a readable Parquet file: {e}") from None
        columns = table.column_names
        for key, name in ((prompt_key, "data.prompt_key"), (ground_truth_key, "data.ground_truth_key")):
            if key not in columns:
                raise ValueError(f"data file {path} has no column '{key}' (set {name}); "
                                 f"its columns are: {', '.join(columns)}")
        prompts = table.column(prompt_key).to_pylist()
        truths = table.column(ground_truth_key).to_pylist()
        sources = table.column("data_source").to_pylist() if "data_source" in columns else [""] * len(prompts)
        extras = table.column("extra").to_pylist() if "extra" in columns else [None] * len(prompts)
        for i, (prompt, truth, source, extra) in enumerate(zip(prompts, truths, sources, extras)):
            if not isinstance(prompt, str):
                raise ValueError(f"data file {path} row {i}: column '{prompt_key}' holds {type(prompt).__name__}, "
                                 f"expected text (launch/prepare_data.py writes the expected format)")
            try:
                extra = json.loads(extra) if isinstance(extra, str) else (extra or {})
            except json.JSONDecodeError as e:
                raise ValueError(f"data file {path} row {i}: column 'extra' is not JSON ({e})") from None
            rows.append({"prompt": prompt, "ground_truth": "" if truth is None else str(truth),
                         "data_source": source or "", "extra": extra})
    return rows


class PromptDataset:
    """This DP rank's share of each step's prompts, in a seeded order that is resumable."""

    def __init__(self, files: Sequence[str], *, prompts_per_step: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 1, shuffle: bool = True, prompt_key: str = "prompt",
                 ground_truth_key: str = "ground_truth", tokenizer: Tokenizer | None = None,
                 max_prompt_tokens: int | None = None, apply_chat_template: bool = False,
                 log: Callable[[str], None] = logger.warning):
        if prompts_per_step % dp_size:
            raise ValueError(f"prompts_per_step = {prompts_per_step} is not divisible by dp_size = {dp_size}")
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        self.prompts_per_step, self.dp_rank, self.dp_size = prompts_per_step, dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.files = [str(f) for f in files]
        rows = read_prompt_files(self.files, prompt_key, ground_truth_key)
        self.num_dropped = 0
        if tokenizer is not None:
            for r in rows:
                r["prompt_ids"] = encode_prompt(tokenizer, r["prompt"], apply_chat_template)
            if max_prompt_tokens is not None:
                kept = [r for r in rows if len(r["prompt_ids"]) <= max_prompt_tokens]
                self.num_dropped = len(rows) - len(kept)
                if self.num_dropped:
                    log(f"dropped {self.num_dropped} of {len(rows)} prompts longer than "
                        f"data.max_prompt_tokens = {max_prompt_tokens} tokens")
                rows = kept
        if len(rows) < prompts_per_step:
            raise ValueError(f"{', '.join(self.files)}: {len(rows)} usable prompts, fewer than "
                             f"data.prompts_per_step = {prompts_per_step}")
        self.rows = rows
        self.steps_per_epoch = len(rows) // prompts_per_step  # the incomplete last batch is skipped
        self.epoch, self.step_in_epoch = 0, 0
        self._order_epoch, self._order = -1, None

    def __len__(self) -> int:
        return len(self.rows)

    def check_vocab(self, vocab_size: int) -> None:
        """Every prompt token id must be one the model has: a tokenizer larger than the model's
        embedding would otherwise fail inside rollout (IndexError; a device-side assert on GPU)."""
        for r in self.rows:
            ids = r.get("prompt_ids") or []
            if ids and max(ids) >= vocab_size:
                raise ValueError(f"{', '.join(self.files)}: prompt {r['prompt'][:40]!r} has token id {max(ids)}, but the "
                                 f"model has {vocab_size} tokens (ids 0 .. {vocab_size - 1}): the tokenizer in model.path "
                                 f"does not belong to its model; use the tokenizer the model was trained with")

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row order of an epoch: a permutation seeded by (seed, epoch), or the file order."""
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next_step(self) -> list[PromptRow]:
        """This rank's prompts of the next step (prompts_per_step / dp_size rows); advances."""
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            self._order_epoch, self._order = self.epoch, self.epoch_order(self.epoch)
        per_rank = self.prompts_per_step // self.dp_size
        start = self.step_in_epoch * self.prompts_per_step
        batch = []
        for g in range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank):
            row = int(self._order[start + g])
            r = self.rows[row]
            batch.append(PromptRow(global_index=g, row=row, prompt=r["prompt"], ground_truth=r["ground_truth"],
                                   data_source=r["data_source"], extra=r["extra"], prompt_ids=r.get("prompt_ids")))
        self.step_in_epoch += 1
        return batch

    def state_dict(self) -> dict:
        """Position to resume from (plain ints, JSON-friendly)."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed,
                "num_prompts": len(self.rows), "prompts_per_step": self.prompts_per_step}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_prompts", "prompts_per_step"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise ValueError(f"cannot resume the data position: the checkpoint has {key} = {state[key]}, "
                                 f"this run has {mine} (different data files or settings)")
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
