"""Loading files megarl wrote, without running code planted in them: torch.load limited to plain data
(`load_plain`) and DCP's `.metadata` pickle unpickled first by a restricted Unpickler
(`check_dcp_metadata`). Both wrap pickle, which executes whatever a file names; every checkpoint
reader (the engines', the run's, the supervised stages') goes through here."""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than tensors and plain data: loading it could run code."""


def load_plain(path: str | os.PathLike) -> Any:
    """torch.load with weights_only=True: tensors, numbers, strings and containers only.

    Every file megarl writes (trainer.pt, engine_extra.pt, rng/*.pt) is plain data, so a file that
    needs anything else was not written by megarl, and unpickling it could execute code planted in
    it: refused with an UnsafeCheckpointError naming the file, nothing of it executed.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsafeCheckpointError(
            f"refusing to load {path}: it holds objects other than tensors and plain data ({first}); "
            f"megarl never writes such files, so it was modified or comes from elsewhere. Loading it could "
            f"run code: use a checkpoint you trust") from None


def check_dcp_metadata(path: str | os.PathLike) -> None:
    """Refuse a torch.distributed.checkpoint `.metadata` file that could run code when unpickled.

    DCP reads it with plain pickle.load. It is unpickled here first by an Unpickler that resolves
    only DCP's metadata classes, torch.Size / dtypes and a few builtins; anything else (a planted
    `exec`, `os.system`, ...) raises UnsafeCheckpointError before any of it is called.
    """
    def allowed(module: str, name: str) -> bool:
        if module.startswith("torch.distributed.checkpoint."):
            return True
        if module == "torch":
            return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)) or name == "Size"
        return (module, name) in {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                                  ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}

    class _Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if not allowed(module, name):
                raise UnsafeCheckpointError(
                    f"refusing to load {path}: it references {module}.{name}, which is not checkpoint metadata; "
                    f"unpickling it could run code. megarl never writes such files: use a checkpoint you trust")
            return super().find_class(module, name)

    with open(path, "rb") as f:
        try:
            _Restricted(f).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # truncated or not a pickle: DCP's own error would be a traceback
            raise ValueError(f"{path} is not a readable checkpoint metadata file ({type(e).__name__}: {e})") from None
