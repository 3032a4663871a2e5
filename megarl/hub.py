"""Models by name: a Hugging Face hub id (`org/name`, `org/name@revision`) wherever megarl takes a
model directory, resolved into the standard Hugging Face cache as transformers and vLLM do.

    ref = parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct@main")   # None: a local path
    snap = resolve(ref, key="model.path")                    # Snapshot(repo_id, revision=<commit>, path)

A string is a hub id only when no file or directory of that name exists (a local path always
wins) and it has the hub's shape, `namespace/name` with one slash; anything else is a path, and a
missing path keeps its own "does not exist" error. The cache is the one huggingface_hub uses,
read from the environment at call time (HF_HUB_CACHE, HF_HOME, ...); HF_HUB_OFFLINE=1 never
touches the network and tokens come from HF_TOKEN or `hf auth login`, as everywhere else.

Only the files megarl reads are fetched (DOWNLOAD_PATTERNS). In a multi-process job the download
happens once per node (`resolve_on_each_node`, a collective): global rank 0 pins each id to a
commit, local rank 0 of every node fetches that commit while the others wait, and every rank then
reads the same snapshot. This module imports neither torch nor transformers at the top, so
config validation and the planner can use it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
import json
from pathlib import Path
from typing import Mapping

# config.json and generation_config.json, the tokenizer in each format transformers reads, the
# chat template, and the weights with their index: nothing else megarl loads (no *.bin, *.pt,
# *.gguf, original/ checkpoints, READMEs or images).
DOWNLOAD_PATTERNS = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken", "chat_template.jinja", "chat_template.json",
    "*.safetensors", "*.safetensors.index.json",
)
CONFIG_ONLY = ("config.json",)  # what the planner reads

# huggingface_hub's repo-id rule: `namespace/name` from letters, digits, '-', '_', '.', at most 96
# characters, no '--' or '..', not starting or ending with '-' or '.'.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TRUE = ("1", "on", "yes", "true")


class HubError(ValueError):
    """A hub id that cannot be resolved; the message is one line naming the id, the cache and the fix."""


@dataclass(frozen=True)
class HubRef:
    """A model on the Hugging Face hub; revision None means the default branch (main)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class Snapshot:
    """A resolved hub model: the id, the commit it resolved to and the cache directory holding it."""

    repo_id: str
    revision: str  # the commit hash
    path: str


def parse_hub_id(value: str | os.PathLike | None) -> HubRef | None:
    """The hub reference `value` names, or None when it is a local path (existing or path-shaped)."""
    if value is None:
        return None
    text = str(value)
    if not text or os.path.exists(text):
        return None  # a local directory or file of that name wins over an id
    if text.startswith(("/", ".", "~")) or "\\" in text or text.endswith(".json"):
        return None
    repo_id, at, revision = text.partition("@")
    if at and not revision:
        return None
    if not _REPO_ID.fullmatch(repo_id) or len(repo_id) > 96 or "--" in repo_id or ".." in repo_id:
        return None
    return HubRef(repo_id, revision or None)


def cache_dir() -> str:
    """The hub cache huggingface_hub uses, from the environment now (not at import time)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def offline() -> bool:
    """HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) is set: never touch the network."""
    return any(os.environ.get(var, "").strip().lower() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cached(ref: HubRef, patterns=DOWNLOAD_PATTERNS) -> Snapshot | None:
    """The snapshot of `ref` already in the cache (a branch or tag through refs/), else None; no network."""
    # deferred: huggingface_hub, needed only to fetch a model by hub id
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache_dir(), local_files_only=True,
                                 allow_patterns=list(patterns))
    except (LocalEntryNotFoundError, OSError):  # IncompleteSnapshotError is one: a half-finished download
        return None
    return Snapshot(ref.repo_id, Path(path).name, path)


def resolve(ref: HubRef, key: str = "model.path", patterns=DOWNLOAD_PATTERNS) -> Snapshot:
    """`ref` in the cache, downloading what is missing unless offline; HubError (one line) when it cannot be had."""
    if offline():
        snap = cached(ref, patterns)
        if snap is None:
            raise HubError(not_cached_message(ref, key))
        return snap
    # deferred: huggingface_hub, needed only to fetch a model by hub id
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        path = snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache_dir(), allow_patterns=list(patterns),
                                 endpoint=os.environ.get("HF_ENDPOINT"))  # read now, as the cache is (a mirror)
    except RevisionNotFoundError:
        raise HubError(f"{key}: {ref.repo_id} has no revision {ref.revision!r} on the Hugging Face hub; give a branch, "
                       f"tag or commit of it after '@'") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise HubError(f"{key}: {ref} is not a local directory, and the Hugging Face hub has no model of that id that "
                       f"this machine may read (a typo, or a gated/private model: set HF_TOKEN to a token with access; "
                       f"cache searched: {cache_dir()})") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        cause = err.__cause__ or err  # huggingface_hub wraps the connection error it met
        reason = " ".join(str(cause).split())[:120]
        raise HubError(f"{key}: cannot download {ref} from the Hugging Face hub ({type(cause).__name__}: {reason}) and "
                       f"it is not in the cache {cache_dir()}: check the network, or set HF_HUB_CACHE (or HF_HOME) to a "
                       f"cache that holds it and HF_HUB_OFFLINE=1") from None
    return Snapshot(ref.repo_id, Path(path).name, path)


def not_cached_message(ref: HubRef, key: str) -> str:
    """The one line for an id that is not in the cache while HF_HUB_OFFLINE forbids downloading it."""
    command = f"hf download {ref.repo_id}" + (f" --revision {ref.revision}" if ref.revision else "")
    return (f"{key}: {ref} is not a local directory and not in the Hugging Face cache {cache_dir()} (HF_HUB_OFFLINE is "
            f"set, so it is not downloaded): download it where there is network (unset HF_HUB_OFFLINE, or `{command}`), "
            f"or set HF_HUB_CACHE (or HF_HOME) to the cache that holds it")


def local_path(value: str, key: str, patterns=DOWNLOAD_PATTERNS) -> str:
    """For one-process tools: `value` itself when it is a path, else its snapshot directory (downloaded if needed)."""
    ref = parse_hub_id(value)
    return value if ref is None else resolve(ref, key, patterns).path


def local_path_on_each_node(value: str, key: str, initialize=lambda: None) -> str:
    """For multi-process tools: `value` when it is a path, else its snapshot directory fetched once
    per node (resolve_on_each_node) after `initialize()` starts the process group. HubError, on
    every rank, when it cannot be had; offline and not cached is found before any process group."""
    ref = parse_hub_id(value)
    if ref is None:
        return value
    if offline() and cached(ref) is None:
        raise HubError(not_cached_message(ref, key))
    initialize()
    snapshots, problem = resolve_on_each_node({key: ref})
    if problem is not None:
        raise HubError(problem)
    return snapshots[key].path


def resolve_on_each_node(refs: Mapping[str, HubRef]) -> tuple[dict[str, Snapshot], str | None]:
    """Collective over the default process group: ({key: Snapshot}, None), or ({}, one-line problem)
    on every rank. Global rank 0 resolves each id to a commit (downloading it if needed) while the
    others wait; then local rank 0 of every other node fetches that same commit (a no-op on a
    shared cache), so a node never downloads twice and every rank reads the same commit, even if a
    branch moves during start-up. Needs LOCAL_RANK (torchrun sets it) to tell nodes apart."""
    import torch.distributed as dist  # deferred: torch; the config check imports megarl.hub without it

    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    pinned, problem = {}, None
    if rank == 0:
        try:
            pinned = {key: resolve(ref, key).revision for key, ref in refs.items()}
        except HubError as err:
            problem = str(err)
    box = [pinned, problem]
    dist.broadcast_object_list(box, src=0)
    pinned, problem = box
    if problem is not None:
        return {}, problem
    exact = {key: HubRef(ref.repo_id, pinned[key]) for key, ref in refs.items()}
    problem = None
    if local_rank == 0 and rank != 0:
        try:
            for key, ref in exact.items():
                resolve(ref, key)
        except HubError as err:
            problem = f"{err} (on the node of rank {rank})"
    dist.barrier()  # the node's download is complete before any of its ranks reads the cache
    snapshots = {}
    for key, ref in exact.items():
        snapshots[key] = cached(ref)
        if snapshots[key] is None and problem is None:
            problem = f"{not_cached_message(ref, key)} (rank {rank}: local rank 0 of this node did not fetch it)"
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    problem = next((p for p in problems if p is not None), None)
    return ({}, problem) if problem is not None else (snapshots, None)


def recorded(snapshots: Mapping[str, Snapshot]) -> dict[str, str]:
    """Flat entries for the run's records and the resume change check: `hub.<key>.revision` (a change
    is a change of the model) and `hub.<key>.snapshot` (where it was read; a move changes nothing)."""
    out = {}
    for key, snap in sorted(snapshots.items()):
        out[f"hub.{key}.id"] = snap.repo_id
        out[f"hub.{key}.revision"] = snap.revision
        out[f"hub.{key}.snapshot"] = snap.path
    return out


def recorded_ref(run_dir: str | os.PathLike, key: str, value: str) -> str:
    """`value` pinned to the commit the run's last segment resolved it to (`id@commit`), when it is a
    hub id the run recorded: tools that read a run's model (export) then see the files it trained from."""
    ref = parse_hub_id(value)
    history = sorted((Path(run_dir) / "config_history").glob("step_*.json"))
    if ref is None or not history:
        return value
    commit = json.loads(history[-1].read_text()).get(f"hub.{key}.revision")
    return f"{ref.repo_id}@{commit}" if commit else value


def describe(snapshots: Mapping[str, Snapshot]) -> str:
    """Comment lines for the resolved config.yaml (a comment keeps the file loadable by load_config)."""
    if not snapshots:
        return ""
    lines = ["# Hugging Face hub models, as resolved for this segment (key: id @ commit -> snapshot):"]
    lines += [f"#   {key}: {s.repo_id} @ {s.revision} -> {s.path}" for key, s in sorted(snapshots.items())]
    return "\n".join(lines) + "\n"
