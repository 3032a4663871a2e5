"""Write prompt datasets as Parquet: columns prompt, ground_truth, data_source, extra (JSON text).

Used by `launch/prepare_data.py` and by `data.auto_prepare` (the demo writes its own data).
Files are written to a temporary name and renamed, so ranks that prepare concurrently, or a
crash mid-write, never leave a truncated file behind.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
import random

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.data.arithmetic import ArithmeticTask
from megarl.data.lookup_table import lookup_rows

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GSM8K_DIR = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
# The instruction of verl's examples/data_preprocess/gsm8k.py, so rewards and numbers compare.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_DATA_SOURCE = "openai/gsm8k"
_VAL_INDEX_OFFSET = 10**9  # arithmetic validation rows are drawn from a disjoint index range


def write_parquet(rows: list[dict], path: str | os.PathLike) -> None:
    """Write rows {prompt, ground_truth, data_source, extra: dict} atomically to `path`."""
    table = pa.table({
        "prompt": pa.array([r["prompt"] for r in rows], pa.string()),
        "ground_truth": pa.array([str(r["ground_truth"]) for r in rows], pa.string()),
        "data_source": pa.array([r["data_source"] for r in rows], pa.string()),
        "extra": pa.array([json.dumps(r.get("extra", {}), sort_keys=True) for r in rows], pa.string()),
    })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def gsm8k_final_answer(answer: str) -> str:
    """'... #### 1,234' -> '1234' (the reference solution's final number)."""
    if "####" not in answer:
        raise ValueError("no '####' in GSM8K answer")
    return answer.split("####")[-1].strip().replace(",", "")


def read_gsm8k_jsonl(path: str | os.PathLike, split: str) -> list[dict]:
    """Rows from a GSM8K JSONL file (one {"question", "answer"} object per line)."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                question, answer = item["question"], item["answer"]
                truth = gsm8k_final_answer(answer)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a GSM8K record with 'question' and an 'answer' "
                                 f"ending in '#### <number>' ({type(e).__name__}: {e})") from None
            rows.append({"prompt": f"{question} {GSM8K_INSTRUCTION}", "ground_truth": truth,
                         "data_source": GSM8K_DATA_SOURCE,
                         "extra": {"split": split, "index": len(rows), "question": question, "answer": answer}})
    return rows


def gsm8k_sources(input_path: str | os.PathLike | None = None, option: str = "--input") -> dict[str, Path]:
    """{'train': ..., 'test': ...} JSONL files: a directory with train.jsonl / test.jsonl, or one
    .jsonl file (used as train); None = ../shared/data/gsm8k next to the repository. `option` is
    the flag or config key that sets input_path, named in the error."""
    source = Path(input_path) if input_path is not None else DEFAULT_GSM8K_DIR
    if source.is_file():
        return {"train": source}
    splits = {s: source / f"{s}.jsonl" for s in ("train", "test") if (source / f"{s}.jsonl").is_file()}
    if "train" not in splits:
        given = "" if input_path is not None else f" ({option} not given: the default is {DEFAULT_GSM8K_DIR})"
        raise ValueError(f"GSM8K input not found: no {source / 'train.jsonl'}{given}; set {option} to a directory "
                         f"with train.jsonl and test.jsonl, or to one .jsonl file")
    return splits


def prepare_gsm8k(out_dir: str | os.PathLike, input_path: str | os.PathLike | None = None) -> dict[str, Path]:
    """GSM8K JSONL -> <out_dir>/{train,test}.parquet (test only when the input has it)."""
    written = {}
    for split, path in gsm8k_sources(input_path).items():
        written[split] = Path(out_dir) / f"{split}.parquet"
        write_parquet(read_gsm8k_jsonl(path, split), written[split])
    return written


def arithmetic_rows(task: ArithmeticTask, count: int, split: str) -> list[dict]:
    """`count` rows of the task; train and test draw from disjoint index ranges."""
    offset = 0 if split == "train" else _VAL_INDEX_OFFSET
    rows = [task.sample(offset + i) for i in range(count)]
    for row in rows:
        row["extra"]["split"] = split
    return rows


def prepare_arithmetic(out_dir: str | os.PathLike, kind: str = "copy", num_digits: int = 3,
                       train_size: int = 20000, val_size: int = 512) -> dict[str, Path]:
    """The generated demo task -> <out_dir>/{train,test}.parquet."""
    task = ArithmeticTask(kind=kind, num_digits=num_digits)
    written = {"train": Path(out_dir) / "train.parquet", "test": Path(out_dir) / "test.parquet"}
    write_parquet(arithmetic_rows(task, train_size, "train"), written["train"])
    write_parquet(arithmetic_rows(task, val_size, "test"), written["test"])
    return written


DATA_FILE_KEYS = ("data.train_files", "data.val_files")


def user_data_files(data_cfg, overrides) -> set[str]:
    """The data files the user typed on the command line (`data.train_files=...` overrides)."""
    keys = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    paths: set[str] = set()
    if "data.train_files" in keys:
        paths.update(data_cfg.train_files)
    if "data.val_files" in keys:
        paths.update(data_cfg.val_files)
    return paths


def prepare_if_missing(data_cfg, user_files=()) -> bool:
    """`data.auto_prepare`: write train_files[0] (and val_files[0]) when train_files[0] is missing.

    Only at the paths the config file names: a file given on the command line (`user_files`, see
    `user_data_files`) is never generated, whatever auto_prepare says. A typo there would
    otherwise create directories wherever it points and train on synthetic data; a missing user
    file is an error instead (`missing_user_files`). Returns True when it wrote files. Safe to
    call on every rank (atomic renames), though rank 0 then a barrier saves the duplicate work.
    """
    if data_cfg.auto_prepare is None or os.path.exists(data_cfg.train_files[0]):
        return False
    targets = {"train": data_cfg.train_files[0]}
    if data_cfg.val_files and not os.path.exists(data_cfg.val_files[0]):
        targets["test"] = data_cfg.val_files[0]
    refused = [path for path in targets.values() if path in set(user_files)]
    if refused:
        raise ValueError(f"data file {refused[0]} (given on the command line) does not exist; data.auto_prepare "
                         f"writes only the paths of the config file. Create it with launch/prepare_data.py, or drop the override")
    if data_cfg.auto_prepare == "arithmetic":
        a = data_cfg.arithmetic
        task, sizes = ArithmeticTask(kind=a.kind, num_digits=a.num_digits), {"train": a.train_size, "test": a.val_size}
        rows = {split: arithmetic_rows(task, sizes[split], split) for split in targets}
    elif data_cfg.auto_prepare == "lookup":
        a = data_cfg.arithmetic
        sizes = {"train": a.train_size, "test": a.val_size}
        rows = {split: lookup_rows(sizes[split], split, a.num_digits) for split in targets}
    else:
        sources = gsm8k_sources(data_cfg.gsm8k_source, option="data.gsm8k_source")
        missing = [split for split in targets if split not in sources]
        if missing:
            raise ValueError(f"data.auto_prepare=gsm8k: no {missing[0]}.jsonl next to {sources['train']}")
        rows = {split: read_gsm8k_jsonl(sources[split], split) for split in targets}
    for split, path in targets.items():
        write_parquet(rows[split], path)
    return True


# --- the supervised stages' formats (megarl.supervised; docs/sft_rm.md) -----------------------------------

def write_table(columns: dict[str, list], path: str | os.PathLike) -> None:
    """Write columns {name: values} atomically to `path` as Parquet (types inferred: text, or lists of messages)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(pa.table(columns), tmp)
    os.replace(tmp, path)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The objects of a JSONL file, one per non-empty line; ValueError naming the line otherwise."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(item).__name__}")
            rows.append(item)
    return rows


def sft_columns(rows: list[dict], source: str) -> dict[str, list]:
    """SFT columns from records: {messages} (a chat), or {prompt, response}, or a prompt dataset's
    {prompt, ground_truth} (the reference answer is the response). ValueError naming the record."""
    if rows and all("messages" in r for r in rows):
        return {"messages": [r["messages"] for r in rows]}
    out: dict[str, list] = {"prompt": [], "response": []}
    for i, r in enumerate(rows):
        answer = r.get("response", r.get("ground_truth"))
        if "prompt" not in r or answer is None:
            raise ValueError(f"{source} record {i}: an SFT record needs prompt and response (or ground_truth), or messages")
        out["prompt"].append(str(r["prompt"]))
        out["response"].append(str(answer))
    return out


def preference_columns(rows: list[dict], source: str) -> dict[str, list]:
    """Preference columns {prompt, chosen, rejected} from records; ValueError naming the record."""
    out: dict[str, list] = {"prompt": [], "chosen": [], "rejected": []}
    for i, r in enumerate(rows):
        missing = [k for k in out if k not in r]
        if missing:
            raise ValueError(f"{source} record {i}: a preference record needs prompt, chosen and rejected (no {missing[0]})")
        for k in out:
            out[k].append(str(r[k]))
    return out


def wrong_answer(truth: str, index: int) -> str:
    """A wrong answer to an arithmetic row, of one of five kinds chosen by the row: one digit changed,
    the last digit dropped, one digit too many, two digits swapped (or changed when equal), random digits.
    The kinds are the mistakes a policy makes on the way to the task (docs/sft_rm.md)."""
    rng = random.Random(f"wrong:{index}")
    digits = "0123456789"
    kind = index % 5
    if kind == 0 or (kind == 3 and len(set(truth)) == 1) or (kind == 1 and len(truth) == 1):
        i = rng.randrange(len(truth))
        return truth[:i] + rng.choice(digits.replace(truth[i], "")) + truth[i + 1:]
    if kind == 1:
        return truth[:-1]
    if kind == 2:
        return truth + rng.choice(digits)
    if kind == 3:
        i, j = rng.sample([k for k in range(len(truth))], 2)
        while truth[i] == truth[j]:
            i, j = rng.sample(range(len(truth)), 2)
        s = list(truth)
        s[i], s[j] = s[j], s[i]
        return "".join(s)
    while True:
        answer = "".join(rng.choice(digits) for _ in range(len(truth)))
        if answer != truth:
            return answer


def prepare_arithmetic_formats(out_dir: str | os.PathLike, fmt: str, kind: str = "copy", num_digits: int = 3,
                               train_size: int = 20000, val_size: int = 512, train_offset: int = 0) -> dict[str, Path]:
    """The demo task as SFT rows (fmt 'sft': prompt, response = the answer) or preference pairs (fmt
    'preference': prompt, chosen = the answer, rejected = `wrong_answer`), both splits. train_offset:
    the first training row's index in the task, so that stages can train on different parts of it."""
    task = ArithmeticTask(kind=kind, num_digits=num_digits)
    written = {}
    for split, count in (("train", train_size), ("test", val_size)):
        offset = train_offset if split == "train" else _VAL_INDEX_OFFSET
        rows = [task.sample(offset + i) for i in range(count)]
        if fmt == "sft":
            columns = {"prompt": [r["prompt"] for r in rows], "response": [r["ground_truth"] for r in rows],
                       "ground_truth": [r["ground_truth"] for r in rows]}
        else:
            columns = {"prompt": [r["prompt"] for r in rows], "chosen": [r["ground_truth"] for r in rows],
                       "rejected": [wrong_answer(r["ground_truth"], offset + i) for i, r in enumerate(rows)]}
        written[split] = Path(out_dir) / f"{split}.parquet"
        write_table(columns, written[split])
    return written


def prepare_jsonl_format(out_dir: str | os.PathLike, fmt: str, input_path: str | os.PathLike) -> dict[str, Path]:
    """JSONL records -> <out_dir>/{train,test}.parquet in the SFT or preference format; input_path is a
    directory with train.jsonl (and test.jsonl) or one .jsonl file (the train split)."""
    source = Path(input_path)
    splits = {"train": source} if source.is_file() else {s: source / f"{s}.jsonl" for s in ("train", "test")
                                                          if (source / f"{s}.jsonl").is_file()}
    if "train" not in splits:
        raise ValueError(f"--input {source}: neither a .jsonl file nor a directory with train.jsonl")
    columns_of = sft_columns if fmt == "sft" else preference_columns
    written = {}
    for split, path in splits.items():
        written[split] = Path(out_dir) / f"{split}.parquet"
        write_table(columns_of(read_jsonl(path), str(path)), written[split])
    return written
