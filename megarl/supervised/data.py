"""Rows of the supervised stages: Parquet -> token sequences, the bad-row rules, the row order.

SFT rows are `prompt` + `response` (text), or `messages` (a chat: the last message is the assistant's
answer, the ones before it the prompt, both rendered by the tokenizer's chat template). The prompt is
encoded as PPO encodes it (megarl.data.dataset.encode_prompt), the response without special tokens
and followed by eos, so an SFT model answers the prompts PPO will give it and stops as exact match
expects (megarl.tools.eval_exact_match).

Preference rows are `prompt`, `chosen`, `rejected`; each side is encoded as `reward.model_path`
scores a response (megarl.rewards.model.RewardModel: the text prompt + response, encoded once), so
the trained reward model scores PPO's samples as it was trained.

Bad rows (docs/sft_rm.md): a missing column stops the run (exit 2, the file and column named).
An empty response / chosen / rejected, a pair whose chosen equals its rejected and a row longer than
supervised.max_length tokens are refused the same way under supervised.bad_rows=error (the default),
or skipped and counted under supervised.bad_rows=skip (one line per file: the count and the first
such row's number, column and problem).

Order: as megarl.data.dataset.PromptDataset orders prompts: a permutation per epoch seeded by
(seed, epoch); step s of an epoch is the global batch order[s * rows_per_step : (s + 1) * rows_per_step]
and DP rank r takes its contiguous block r, so every layout trains on the same global batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from megarl.data.dataset import data_file_problem, encode_prompt

SFT_COLUMNS = (("prompt", "response"), ("messages",))
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class SftExample:
    """One SFT row: prompt tokens, then response tokens (eos last); the loss is on the response only."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


@dataclass(frozen=True)
class PreferencePair:
    """One preference row: the full token sequences (prompt + answer) of the chosen and rejected sides."""

    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


class BadRow(ValueError):
    """A row the stage cannot train on; the message names the file, row and column."""


def _read_table(path: str):
    problem = data_file_problem(path)
    if problem:
        raise ValueError(f"data file {problem}")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"data file {path} is not a readable Parquet file: {err}") from None


def _text(path: str, row: int, column: str, value: Any) -> str:
    if not isinstance(value, str):
        raise BadRow(f"data file {path} row {row} column '{column}': holds {type(value).__name__}, expected text")
    if not value.strip():
        raise BadRow(f"data file {path} row {row} column '{column}': empty")
    return value


def _sft_row(tokenizer, path: str, row: int, values: dict, max_length: int) -> SftExample:
    eos = tokenizer.eos_token_id
    if "messages" in values:
        messages = values["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRow(f"data file {path} row {row} column 'messages': expected a non-empty list of "
                         f"{{role, content}} messages")
        if messages[-1].get("role") != "assistant":
            raise BadRow(f"data file {path} row {row} column 'messages': the last message is the answer trained on "
                         f"and must have role 'assistant', not {messages[-1].get('role')!r}")
        _text(path, row, "messages", messages[-1].get("content"))
        prompt = _ids(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True))
        full = _ids(tokenizer.apply_chat_template(messages, tokenize=True))
        if full[:len(prompt)] != prompt or len(full) == len(prompt):
            raise BadRow(f"data file {path} row {row} column 'messages': the chat template does not render the chat as "
                         f"its prompt followed by the answer (the loss could not find the answer's tokens)")
        response = full[len(prompt):]
        if eos is not None and response[-1] != eos:
            response.append(eos)
        column = "messages"
    else:
        prompt = encode_prompt(tokenizer, _text(path, row, "prompt", values["prompt"]))
        response = list(tokenizer.encode(_text(path, row, "response", values["response"]), add_special_tokens=False))
        response += [eos] if eos is not None else []
        column = "response"
    if len(prompt) + len(response) > max_length:
        raise BadRow(f"data file {path} row {row} column '{column}': {len(prompt) + len(response)} tokens, longer than "
                     f"supervised.max_length = {max_length}")
    return SftExample(tuple(prompt), tuple(response))


def _pair_row(tokenizer, path: str, row: int, values: dict, max_length: int) -> PreferencePair:
    prompt = values["prompt"]
    if not isinstance(prompt, str):
        raise BadRow(f"data file {path} row {row} column 'prompt': holds {type(prompt).__name__}, expected text")
    chosen, rejected = (_text(path, row, c, values[c]) for c in ("chosen", "rejected"))
    if chosen == rejected:
        raise BadRow(f"data file {path} row {row} column 'rejected': equals column 'chosen' (a pair needs two answers)")
    sides = {}
    for column, answer in (("chosen", chosen), ("rejected", rejected)):
        sides[column] = tuple(_ids(tokenizer.encode(prompt + answer)))  # as RewardModel encodes what it scores
        if len(sides[column]) + 1 > max_length:  # + the placeholder token the score is read through
            raise BadRow(f"data file {path} row {row} column '{column}': {len(sides[column]) + 1} tokens, longer than "
                         f"supervised.max_length = {max_length}")
    return PreferencePair(sides["chosen"], sides["rejected"])


def _ids(ids) -> list[int]:
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding from newer transformers
        ids = ids["input_ids"]
    return list(ids)


def read_rows(files: Sequence[str], kind: str, tokenizer, max_length: int, bad_rows: str = "error",
              log: Callable[[str], None] = print) -> list:
    """Every usable row of the files, in file order: SftExample (kind 'sft') or PreferencePair
    (kind 'preference'). ValueError (one line) for a missing column, or a bad row under bad_rows=error."""
    examples = []
    for path in map(str, files):
        table = _read_table(path)
        columns = table.column_names
        if kind == "sft":
            wanted = next((c for c in SFT_COLUMNS if all(x in columns for x in c)), None)
            if wanted is None:
                missing = "response" if "prompt" in columns else "prompt"
                raise ValueError(f"data file {path} has no column '{missing}': SFT rows need columns prompt and response, "
                                 f"or messages (launch/prepare_data.py sft writes them); its columns are: {', '.join(columns)}")
            make = _sft_row
        else:
            wanted = PREFERENCE_COLUMNS
            missing = [c for c in wanted if c not in columns]
            if missing:
                raise ValueError(f"data file {path} has no column '{missing[0]}': preference rows need columns prompt, "
                                 f"chosen and rejected (launch/prepare_data.py preference writes them); its columns are: "
                                 f"{', '.join(columns)}")
            make = _pair_row
        data = {c: table.column(c).to_pylist() for c in wanted}
        skipped, first = 0, None
        for row in range(table.num_rows):
            try:
                examples.append(make(tokenizer, path, row, {c: data[c][row] for c in wanted}, max_length))
            except BadRow as err:
                if bad_rows == "error":
                    raise ValueError(f"{err} (supervised.bad_rows=skip skips such rows)") from None
                skipped, first = skipped + 1, first or str(err)
        if skipped:
            log(f"skipped {skipped} of {table.num_rows} rows of data file {path} (supervised.bad_rows=skip); the first: {first}")
    return examples


class RowOrder:
    """This DP rank's rows of each step, in a seeded order that resumes exactly (PromptDataset's scheme)."""

    def __init__(self, num_rows: int, rows_per_step: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool = True,
                 name: str = "data.train_files"):
        if rows_per_step % dp_size:
            raise ValueError(f"supervised.rows_per_step = {rows_per_step} is not divisible by the data-parallel size {dp_size}")
        if num_rows < rows_per_step:
            raise ValueError(f"{name}: {num_rows} usable rows, fewer than supervised.rows_per_step = {rows_per_step}")
        self.num_rows, self.rows_per_step, self.dp_rank, self.dp_size = num_rows, rows_per_step, dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = num_rows // rows_per_step  # the incomplete last batch is skipped
        self.epoch, self.step_in_epoch = 0, 0

    def next_step(self) -> list[int]:
        """The rows of the next step's global batch, by global index (every rank gets all); advances."""
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows) if self.shuffle
                 else np.arange(self.num_rows))
        start = self.step_in_epoch * self.rows_per_step
        self.step_in_epoch += 1
        return [int(r) for r in order[start:start + self.rows_per_step]]

    @property
    def my_block(self) -> range:
        """The global indices of a step's batch that this DP rank trains on (its contiguous block)."""
        per_rank = self.rows_per_step // self.dp_size
        return range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed, "num_rows": self.num_rows,
                "rows_per_step": self.rows_per_step}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_rows", "rows_per_step"):
            if state[key] != self.state_dict()[key]:
                raise ValueError(f"cannot resume the data position: the checkpoint has {key} = {state[key]}, this run has "
                                 f"{self.state_dict()[key]} (different data files or settings)")
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
