"""The optional monitor packages (tensorboard, wandb, prometheus-client), imported only when chosen."""
from __future__ import annotations

import importlib.util


class MissingPackage(ImportError):
    """A chosen logger's package is absent; the message is one line naming the pip command."""


def require(module: str, dist: str, key: str) -> None:
    """Raise MissingPackage unless `module` can be imported (`key`: the setting that wants it)."""
    if importlib.util.find_spec(module) is None:
        raise MissingPackage(f"{key} needs the {dist} package, which is not installed: "
                             f"pip install 'megarl[monitor]' (or pip install {dist})")
