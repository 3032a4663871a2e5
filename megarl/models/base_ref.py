"""The frozen base model a LoRA checkpoint refers to: where it came from and a hash of what it holds.

A LoRA checkpoint (megarl.engine.adapter_checkpoint) keeps only the adapters and their optimizer
state; the base weights are rebuilt from the base model's directory on resume and on export. So the
checkpoint records that directory (`path`: model.path as the run read it, a hub model's local
snapshot included; the demo's tiny random model is a directory written from model.make_tiny's
architecture and seed, so it is covered the same way) and a content hash, and a base whose hash
changed is refused: adapters trained on one base and applied to another give a policy that neither
run trained.

What is hashed: config.json and every weight file (*.safetensors, else *.bin / *.pt), name and
bytes, in name order, with sha256. Those are exactly the inputs `megarl.models.load_model_chunks`
builds the frozen base from (tokenizer files do not change the weights). Hashing the files rather
than the tensors as built keeps it independent of the parallel layout and of the dtype the run
casts to, and lets the run check it before any model is built. The cost is one read of the files
(sha256 runs at about 1-2 GB/s per core: milliseconds for CI's tiny models, a minute or two for a
70B base, which loading it reads anyway); it is computed once per process per unchanged directory.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

BASE_REF_FILE = "base_ref.json"
_CHUNK = 16 << 20
_memo: dict[tuple, "BaseRef"] = {}


@dataclass(frozen=True)
class BaseRef:
    path: str  # the base model directory (absolute)
    sha256: str  # of config.json and the weight files, name and bytes (module docstring)
    files: int
    bytes: int

    def short(self) -> str:
        return self.sha256[:12]


def _hashed_files(model_dir: Path) -> list[Path]:
    weights = sorted(model_dir.glob("*.safetensors")) or sorted([*model_dir.glob("*.bin"), *model_dir.glob("*.pt")])
    if not weights:
        raise FileNotFoundError(f"{model_dir} holds no weight files (*.safetensors, *.bin): not a base model directory")
    config = model_dir / "config.json"
    return ([config] if config.is_file() else []) + weights


def fingerprint(model_dir: str | Path) -> BaseRef:
    """The base reference of a model directory (memoised while its files' sizes and mtimes stay)."""
    root = Path(model_dir).resolve()
    files = _hashed_files(root)
    stats = tuple((f.name, st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()])
    key = (str(root), stats)
    if key not in _memo:
        digest, total = hashlib.sha256(), 0
        for f in files:
            digest.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                while block := fh.read(_CHUNK):
                    digest.update(block)
                    total += len(block)
        _memo[key] = BaseRef(path=str(root), sha256=digest.hexdigest(), files=len(files), bytes=total)
    return _memo[key]


def write(checkpoint_dir: str | Path, ref: BaseRef) -> None:
    Path(checkpoint_dir, BASE_REF_FILE).write_text(json.dumps(asdict(ref), indent=1) + "\n")


def read(checkpoint_dir: str | Path) -> BaseRef | None:
    """The reference recorded in an engine checkpoint directory; None for a full checkpoint."""
    f = Path(checkpoint_dir, BASE_REF_FILE)
    if not f.is_file():
        return None
    data = json.loads(f.read_text())
    return BaseRef(path=str(data["path"]), sha256=str(data["sha256"]), files=int(data["files"]), bytes=int(data["bytes"]))


RESUME_FIX = "or start a new run (another trainer.run_dir, or trainer.resume=never)"


def changed_base(checkpoint_dir: str | Path, model_dir: str | Path, key: str, otherwise: str = RESUME_FIX) -> str | None:
    """None when the engine checkpoint `checkpoint_dir` is a full one or its recorded base is the
    one at `model_dir` (by content); else the one-line refusal. key: the setting naming the base
    (model.path, --model); otherwise: the other way out, after "use <key> ...". A reference or base
    that cannot be read is a refusal too, naming why."""
    try:
        recorded = read(checkpoint_dir)
        if recorded is None:
            return None
        current = fingerprint(model_dir)
    except (OSError, ValueError, KeyError) as err:
        return f"cannot check the base model of LoRA checkpoint {checkpoint_dir} against {model_dir} ({err})"
    if current.sha256 == recorded.sha256:
        return None
    return (f"checkpoint {checkpoint_dir} holds LoRA adapters trained on the base model {recorded.path} (sha256 "
            f"{recorded.short()}), but this run's base {current.path} has sha256 {current.short()}: the adapters do not "
            f"apply to another base; set {key} to the original base weights, {otherwise}")


def recorded_base(checkpoint_dir: str | Path) -> str | None:
    """The base directory an adapter-only checkpoint names, if it still exists on this machine."""
    ref = read(checkpoint_dir)
    return ref.path if ref is not None and os.path.isdir(ref.path) else None
