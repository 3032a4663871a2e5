"""Which Megatron-Core releases megarl supports, and how to compare them.

One place for the version arithmetic that the CPU layer (which seams a release needs) and the
checkpoints (which release wrote them) both use. Releases are compared by (major, minor): patch
releases of one minor line keep the internals the CPU layer patches and the checkpoint format.
"""
from __future__ import annotations

import json
import os
import re

# The audited range: every seam of megarl.platform.cpu_compat was checked against these minor lines.
# 0.16 is the last release for Python 3.11; every release since 0.17 requires Python 3.12.
OLDEST_SUPPORTED = (0, 16)
NEWEST_SUPPORTED = (0, 19)
# The releases `make test` runs the suite on (0.16.1 on Python 3.11, 0.19.2 on Python 3.12).
TESTED_VERSIONS = ("0.16.1", "0.19.2")


class UnsupportedMegatronVersion(RuntimeError):
    pass


def minor_line(version: str) -> tuple[int, int]:
    """'0.19.2' / '0.19.0rc1' / '0.19.2+local' -> (0, 19)."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a Megatron-Core version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def installed_version() -> str:
    """The installed release, e.g. '0.19.2'.

    Without the local label: since 0.19 `megatron.core.__version__` appends the short commit of
    whatever git repository the process runs in ('0.19.2+6fc9bb3' inside a megarl checkout).
    """
    import megatron.core  # deferred: megatron (seconds to import) loads only when this runs

    return megatron.core.__version__.split("+")[0]


def supported_range_text() -> str:
    (a, b), (c, d) = OLDEST_SUPPORTED, NEWEST_SUPPORTED
    return f"{a}.{b}.x to {c}.{d}.x"


def check_megatron_version(version: str | None = None) -> str:
    """Refuse a Megatron-Core release outside the audited range (the CPU layer patches its internals)."""
    if version is None:
        version = installed_version()
    if not OLDEST_SUPPORTED <= minor_line(version) <= NEWEST_SUPPORTED:
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is installed, but megarl supports {supported_range_text()} only "
            f"(tested: {', '.join(TESTED_VERSIONS)}). Install a supported release: "
            f"pip install 'megatron-core=={TESTED_VERSIONS[-1]}' on Python 3.12, "
            f"or 'megatron-core=={TESTED_VERSIONS[0]}' on Python 3.11"
        )
    return version


# --- which release wrote a checkpoint ----------------------------------------------------------------
# Megatron-Core releases whose torch_dist checkpoints older releases cannot read. 0.19 keeps the common
# (non-sharded) state inside the torch_dist files and writes no common.pt, which 0.16 requires.
# Newer releases read older checkpoints: 0.19.2 resumed a 0.16.1 checkpoint to identical weights.
FORMAT_CHANGES = ((0, 19),)
VERSION_FILE = "megatron_core_version.json"
# Checkpoints without VERSION_FILE come from before megarl recorded it, when it supported 0.16 only.
UNRECORDED_VERSION = "0.16.1"


class CheckpointVersionError(ValueError):
    pass


def can_read(written_by: str, reader: str) -> bool:
    """Whether release `reader` reads a torch_dist checkpoint that release `written_by` saved."""
    written, reading = minor_line(written_by), minor_line(reader)
    if written > NEWEST_SUPPORTED and reading < written:
        return False  # a newer release than megarl knows (a GPU run is not version-checked): format unknown
    return not any(reading < change <= written for change in FORMAT_CHANGES)


def record_checkpoint_version(path: str) -> None:
    """Write which Megatron-Core release saved the checkpoint in directory `path` (one rank calls this)."""
    with open(os.path.join(path, VERSION_FILE), "w") as f:
        json.dump({"megatron_core": installed_version()}, f)


def checkpoint_version(path: str) -> str:
    file = os.path.join(path, VERSION_FILE)
    if not os.path.exists(file):
        return UNRECORDED_VERSION
    with open(file) as f:
        return json.load(f)["megatron_core"]


def require_readable_checkpoint(path: str, reader: str | None = None) -> None:
    """Refuse, before Megatron-Core fails inside its loader, a checkpoint this release cannot read."""
    reader = reader or installed_version()
    written_by = checkpoint_version(path)
    if not can_read(written_by, reader):
        raise CheckpointVersionError(
            f"checkpoint {path} was written by megatron-core {written_by}, whose checkpoint format "
            f"megatron-core {reader} (installed) cannot read. Load it with megatron-core {written_by} "
            f"or newer (Python 3.12: pip install 'megatron-core=={TESTED_VERSIONS[-1]}')"
        )
