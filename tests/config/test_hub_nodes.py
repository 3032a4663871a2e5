"""megarl.hub.resolve_on_each_node on 4 gloo ranks posing as 2 nodes of 2 (LOCAL_RANK = rank % 2):
global rank 0 resolves the id (main -> a commit), local rank 0 of the second node fetches exactly
that commit into its own cache, the other ranks download nothing and every rank reads the same commit. The download
is a fake (`fake_resolve`) that models huggingface_hub's: it writes the snapshot into the cache
and returns it; nothing touches the network."""
from __future__ import annotations

import json
import os

import pytest

from conftest import hub_cache, spawn

pytestmark = pytest.mark.multiprocess

COMMIT = "c" * 40


def _worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from megarl import hub

    # each node its own cache: a node that skipped its download would find nothing
    os.environ.update(LOCAL_RANK=str(rank % 2), HF_HUB_CACHE=os.path.join(root, f"cache-node{rank // 2}"))
    dist.init_process_group("gloo", rank=rank, world_size=4, init_method=f"tcp://127.0.0.1:{port}")
    calls = []

    def fake_resolve(ref, key="model.path", patterns=hub.DOWNLOAD_PATTERNS):
        """The hub's answer: main is COMMIT; the files land in the cache (refs/main only when asked for main)."""
        calls.append(str(ref))
        hub_cache(hub.Path(os.environ["HF_HUB_CACHE"]), ref.repo_id, hub.Path(root) / "src", COMMIT,
                  ref="main" if ref.revision is None else None)
        return hub.cached(hub.HubRef(ref.repo_id, COMMIT))

    hub.resolve = fake_resolve
    snaps, problem = hub.resolve_on_each_node({"model.path": hub.HubRef("org/name")})
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump({"calls": calls, "problem": problem, "snapshot": snaps["model.path"].__dict__ if snaps else None}, f)
    dist.destroy_process_group()


def test_one_download_per_node_and_one_commit_everywhere(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    spawn(_worker, 4, str(tmp_path))
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [o["calls"] for o in out] == [["org/name"], [], [f"org/name@{COMMIT}"], []]
    for rank, o in enumerate(out):
        assert o["problem"] is None and o["snapshot"] == {
            "repo_id": "org/name", "revision": COMMIT,
            "path": str(tmp_path / f"cache-node{rank // 2}" / "models--org--name" / "snapshots" / COMMIT)}, out
