"""Models by name (issue 30): which strings are hub ids, the cache look-up under HF_HUB_OFFLINE=1,
the one-line error when an id is not cached, the shipped configs validating against a cache that
holds their models, and a changed hub commit counting as a config change on resume. Every test
sets HF_HUB_OFFLINE=1 and its own HF_HUB_CACHE: no network, no user cache."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, hub_cache
from megarl import hub
from megarl.config import ConfigError, load_config, validate
from megarl.config.inputs import check_model_layout, check_model_path, model_refs, with_snapshots
from megarl.config.resume_changes import ResumeChangeError, check_resume, record_segment

sys.path.insert(0, str(REPO / "tests" / "capacity"))
from hf_configs import DEEPSEEK_V3, GLM45, LLAMA3_70B, QWEN3_4B, QWEN3_235B, QWEN25_05B  # noqa: E402

COMMIT_A, COMMIT_B = "a" * 40, "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache of this test's own, offline."""
    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def _config_dir(tmp_path, hf: dict, name: str = "src"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    return d


@pytest.mark.parametrize("text,want", [
    ("Qwen/Qwen2.5-0.5B-Instruct", ("Qwen/Qwen2.5-0.5B-Instruct", None)),
    ("org/name@v1.0", ("org/name", "v1.0")),
    ("org/name@" + COMMIT_B, ("org/name", COMMIT_B)),
    ("org/name@refs/pr/3", ("org/name", "refs/pr/3")),  # a revision may hold slashes
    ("deepseek-ai/DeepSeek-V3", ("deepseek-ai/DeepSeek-V3", None)),
])
def test_hub_ids_are_recognised(text, want):
    ref = hub.parse_hub_id(text)
    assert (ref.repo_id, ref.revision) == want and str(ref) == text


@pytest.mark.parametrize("text", [
    "/abs/missing/model", "./rel/model", "../model", "~/models/x", "runs/models/tiny-llama-digits",  # path-shaped
    "gpt2",  # one word: a directory that is missing, not a hub id
    "org/name@", "org/", "/name", "a--b/name", "org/na..me", "-org/name", "org/name.",  # not the hub's id rule
    "DeepSeek-V3/config.json", "", None,
])
def test_path_shaped_strings_are_paths(text):
    assert hub.parse_hub_id(text) is None


def test_an_existing_local_path_wins_over_an_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.parse_hub_id("org/name") is not None
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.parse_hub_id("org/name") is None
    (tmp_path / "org" / "name@v1").mkdir()
    assert hub.parse_hub_id("org/name@v1") is None


def test_a_missing_path_keeps_its_error(cache):
    cfg = load_config(None, ["model.path=/nonexistent/model", "data.train_files=[t.parquet]"])
    with pytest.raises(ConfigError, match=r"^model.path: /nonexistent/model does not exist \(give a Hugging Face model directory"):
        check_model_path(cfg)
    assert model_refs(cfg) == {}


def test_cache_lookup_follows_refs_and_commits(cache, tmp_path):
    src = _config_dir(tmp_path, QWEN25_05B)
    snap = hub_cache(cache, "org/name", src, COMMIT_A)
    hub_cache(cache, "org/name", src, COMMIT_B, ref="v2")
    assert hub.cached(hub.HubRef("org/name")) == hub.Snapshot("org/name", COMMIT_A, str(snap))  # refs/main
    assert hub.cached(hub.HubRef("org/name", "v2")).revision == COMMIT_B  # a tag, through refs/v2
    assert hub.cached(hub.HubRef("org/name", COMMIT_B)).revision == COMMIT_B  # a commit, directly
    assert hub.cached(hub.HubRef("org/name", "v3")) is None
    assert hub.cached(hub.HubRef("org/other")) is None
    assert json.loads((snap / "config.json").read_text()) == QWEN25_05B  # through the blob symlink
    # resolve() offline is the same look-up; local_path() gives the snapshot directory
    assert hub.local_path("org/name@v2", "--model").endswith(f"snapshots/{COMMIT_B}")
    assert hub.local_path(str(src), "--model") == str(src)


def test_an_uncached_id_offline_is_one_line_naming_id_cache_and_variable(cache):
    cfg = load_config(None, ["model.path=org/name@v1", "data.train_files=[t.parquet]"])
    with pytest.raises(ConfigError) as err:
        check_model_path(cfg)
    message = str(err.value)
    assert "\n" not in message
    for part in ("model.path: org/name@v1 is not a local directory", str(cache), "HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        assert part in message, message
    with pytest.raises(hub.HubError, match="--model: org/name is not a local directory"):
        hub.local_path("org/name", "--model")


def test_an_unreachable_hub_is_one_line_naming_id_cache_and_variable(cache, monkeypatch):
    """Online, with the hub at a closed port of this machine (nothing leaves it): the download fails."""
    from conftest import free_port

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(hub.HubError) as err:
        hub.resolve(hub.HubRef("org/name"), "model.path")
    message = str(err.value)
    assert "\n" not in message and message.startswith("model.path: cannot download org/name from the Hugging Face hub (")
    assert f"it is not in the cache {cache}: " in message and "HF_HUB_OFFLINE=1" in message, message


def test_every_model_key_is_resolved_and_replaced(cache, tmp_path):
    """critic.model_path and reward.model_path take hub ids too; make_tiny's path never is one."""
    over = ["data.train_files=[t.parquet]", "model.path=org/actor", "critic.model_path=org/critic", "reward.kind=model",
            "reward.model_path=org/rm@v1", "algorithm.adv_estimator=gae"]
    cfg = load_config(None, over)
    assert {k: str(r) for k, r in model_refs(cfg).items()} == {
        "model.path": "org/actor", "critic.model_path": "org/critic", "reward.model_path": "org/rm@v1"}
    with pytest.raises(ConfigError, match="critic.model_path: org/critic is not a local directory"):
        hub_cache(cache, "org/actor", _config_dir(tmp_path, QWEN25_05B), COMMIT_A)
        check_model_path(cfg)
    snaps = {k: hub.Snapshot(r.repo_id, COMMIT_A, f"/cache/{k}") for k, r in model_refs(cfg).items()}
    run_cfg = with_snapshots(cfg, snaps)
    assert (run_cfg.model.path, run_cfg.critic.model_path, run_cfg.reward.model_path) == (
        "/cache/model.path", "/cache/critic.model_path", "/cache/reward.model_path")
    assert cfg.model.path == "org/actor" and run_cfg.model.dtype == cfg.model.dtype  # the original is untouched
    # GRPO has no critic; model.make_tiny makes a directory at model.path
    assert model_refs(load_config(None, over[:3] + ["algorithm.adv_estimator=grpo", "rollout.samples_per_prompt=2"])) \
        .keys() == {"model.path"}
    assert model_refs(load_config(None, over[:2] + ["model.make_tiny.enable=true"])) == {}


# configs/*.yaml naming hub ids -> (the model's config.json, the world size the config is written for)
SHIPPED = {"qwen2.5-0.5b-gsm8k.yaml": (QWEN25_05B, 1), "qwen2.5-0.5b-gsm8k-tool.yaml": (QWEN25_05B, 1),
           "deepseek-v3-671b.yaml": (DEEPSEEK_V3, 256),
           "glm-4.5-355b.yaml": (GLM45, 256), "qwen3-235b-a22b.yaml": (QWEN3_235B, 256),
           "llama-3-70b-lora.yaml": (LLAMA3_70B, 8),
           "qwen3-4b-long-reasoning.yaml": (QWEN3_4B, 8)}


def test_every_shipped_hub_config_is_covered():
    import yaml

    named = {p.name for p in (REPO / "configs").glob("*.yaml")
             if hub.parse_hub_id(yaml.safe_load(p.read_text())["model"]["path"]) is not None}
    assert named == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_validate_unchanged_with_their_model_cached(name, cache, tmp_path):
    hf, world = SHIPPED[name]
    cfg = load_config(str(REPO / "configs" / name))  # no override: the config's own model.path
    with pytest.raises(ConfigError, match=f"model.path: {cfg.model.path} is not a local directory"):
        check_model_path(cfg)  # not cached yet
    hub_cache(cache, cfg.model.path, _config_dir(tmp_path, hf), COMMIT_A)
    validate(cfg, world_size=world)
    check_model_path(cfg)
    check_model_layout(cfg)  # against the cached config.json
    broken = load_config(str(REPO / "configs" / name), ["parallel.tp=3"])
    with pytest.raises(ConfigError, match=r"parallel.tp = 3 does not divide the model.s \d+ (attention|key/value) heads"):
        check_model_layout(broken)  # the proof that the cached config.json was read


def test_a_changed_hub_commit_is_a_config_change_on_resume(tmp_path):
    flat = {"model.path": "org/name", "actor.optim.lr": 1e-6}
    first = {**flat, **hub.recorded({"model.path": hub.Snapshot("org/name", COMMIT_A, "/c1/snapshots/" + COMMIT_A)})}
    record_segment(tmp_path, first, "model: {}\n", 1, 2)
    assert check_resume(tmp_path, first, 2, allow=False) == []
    moved = {**first, "hub.model.path.snapshot": "/c2/snapshots/" + COMMIT_A}  # same commit, another cache
    assert check_resume(tmp_path, moved, 2, allow=False) == [
        f'hub.model.path.snapshot: "/c1/snapshots/{COMMIT_A}" -> "/c2/snapshots/{COMMIT_A}" (does not change results)']
    newer = {**flat, **hub.recorded({"model.path": hub.Snapshot("org/name", COMMIT_B, "/c1/snapshots/" + COMMIT_B)})}
    with pytest.raises(ResumeChangeError, match=f'hub.model.path.revision: "{COMMIT_A}" -> "{COMMIT_B}".*'
                                                "trainer.resume_allow_changes=true"):
        check_resume(tmp_path, newer, 2, allow=False)
    assert f'hub.model.path.revision: "{COMMIT_A}" -> "{COMMIT_B}"' in check_resume(tmp_path, newer, 2, allow=True)
    # a tool reading the run's model (export) is pinned to the commit the run recorded
    assert hub.recorded_ref(tmp_path, "model.path", "org/name") == f"org/name@{COMMIT_A}"
    assert hub.recorded_ref(tmp_path, "model.path", "/a/dir") == "/a/dir"


def test_resolved_config_records_the_snapshot_and_stays_loadable(tmp_path):
    from megarl.config import save_resolved

    cfg = load_config(None, ["model.path=org/name", "data.train_files=[t.parquet]"])
    snaps = {"model.path": hub.Snapshot("org/name", COMMIT_A, "/c/snapshots/" + COMMIT_A)}
    save_resolved(cfg, tmp_path / "config.yaml", footer=hub.describe(snaps))
    text = (tmp_path / "config.yaml").read_text()
    assert f"#   model.path: org/name @ {COMMIT_A} -> /c/snapshots/{COMMIT_A}\n" in text
    assert load_config(tmp_path / "config.yaml") == cfg
