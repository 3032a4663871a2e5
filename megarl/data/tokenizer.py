"""Loading the model directory's tokenizer, with a missing one reported as missing.

transformers' AutoTokenizer, given a directory without tokenizer files, falls through to its
slow-tokenizer converters and reports a missing `sentencepiece` or `tiktoken` package: the fix it
suggests (installing a package) is the wrong one.
"""
from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")


def load_tokenizer(model_dir: str, key: str = "model.path", **kwargs):
    """AutoTokenizer.from_pretrained(model_dir), or a ValueError naming the missing files."""
    # deferred: transformers (seconds to import); megarl.data is read by the config check without it
    from transformers import AutoTokenizer

    directory = Path(model_dir)
    if directory.is_dir() and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{key}: {model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
                         f"tokenizer files of the model it came from into it")
    return AutoTokenizer.from_pretrained(model_dir, **kwargs)
