"""Models by name end to end (issue 30): launch/ppo.py with model.path=org/name read from a hub
cache built by hand, under HF_HUB_OFFLINE=1 (no test touches the network); the same id with
nothing cached exits 2 with one line; a commit that moved between segments is refused on resume
as any other changed setting is, and shown when accepted."""
from __future__ import annotations

import json

import pytest

from conftest import hub_cache, make_model, torchrun
from ppo_helpers import launch, launch_ok, small_run_overrides
from test_launch_errors import run_launch

COMMIT_A, COMMIT_B = "1" * 40, "2" * 40
REPO_ID = "megarl-test/tiny-llama-digits"
# configs/tiny_cpu.yaml's model.make_tiny, written once into the cache instead of made at start-up
TINY = dict(tokenizer="digits", hidden=64, intermediate=256, layers=2, heads=4, kv_heads=2, max_positions=64,
            init_std=0.02, seed=0)


def _offline(cache) -> dict:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_an_uncached_hub_id_exits_2_with_one_line(tmp_path):
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    proc = run_launch(["--config", "configs/tiny_cpu.yaml", "model.make_tiny.enable=false", f"model.path={REPO_ID}"],
                      world_size=2, env=_offline(cache))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"config error: model.path: {REPO_ID} is not a local directory and not in the Hugging "
                               f"Face cache {cache} (HF_HUB_OFFLINE is set"), lines[0]


@pytest.mark.slow
def test_ppo_from_a_hub_id_offline_and_a_moved_commit_on_resume(tmp_path):
    cache, run_dir = tmp_path / "hf-cache", tmp_path / "run"
    model = make_model(tmp_path / "src", "llama", **TINY)
    hub_cache(cache, REPO_ID, model, COMMIT_A)
    env = _offline(cache)
    over = lambda **extra: small_run_overrides(tmp_path, run_dir, **{  # noqa: E731
        "model.path": REPO_ID, "model.make_tiny.enable": "false", "trainer.save_every_steps": 2,
        "algorithm.adv_estimator": "grpo", "rollout.samples_per_prompt": 2, "data.prompts_per_step": 4, **extra})

    # One plain process per segment: resolving across ranks and nodes is tests/config/test_hub_nodes.py's,
    # layouts are tests/trainer/test_ppo_runs.py's; here more ranks would add only start-up time.
    proc = launch_ok(0, over(**{"trainer.total_steps": 2}), env=env)
    assert f"model.path: {REPO_ID} at commit {COMMIT_A} ({cache}/models--megarl-test--tiny-llama-digits/snapshots/" \
           f"{COMMIT_A})" in proc.stdout, proc.stdout
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
    assert not (tmp_path / "model").exists()  # nothing was made at small_run_overrides' own model path
    resolved = (run_dir / "config.yaml").read_text()
    assert f"path: {REPO_ID}\n" in resolved and f"#   model.path: {REPO_ID} @ {COMMIT_A} -> {cache}" in resolved
    segment = json.loads((run_dir / "config_history" / "step_00000001.json").read_text())
    assert segment["hub.model.path.revision"] == COMMIT_A and segment["model.path"] == REPO_ID

    # main moves to a new commit (the same files: only the commit tells them apart)
    hub_cache(cache, REPO_ID, model, COMMIT_B)
    refused = launch(0, over(**{"trainer.total_steps": 4}), env=env)  # refused before any rank starts work
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f'hub.model.path.revision: "{COMMIT_A}" -> "{COMMIT_B}"' in refused.stderr
    assert refused.stderr.count("trainer.resume_allow_changes=true") == 1, refused.stderr

    # accepted: the change is shown, the snapshot's move with it
    proc = launch_ok(0, over(**{"trainer.total_steps": 3, "trainer.resume_allow_changes": "true"}), env=env)
    assert "resumed from" in proc.stdout and "step_00000002" in proc.stdout, proc.stdout
    assert f'changed since the last segment: hub.model.path.revision: "{COMMIT_A}" -> "{COMMIT_B}"\n' in proc.stdout
    assert f'hub.model.path.snapshot: "{cache}/models--megarl-test--tiny-llama-digits/snapshots/{COMMIT_A}" -> ' \
           f'"{cache}/models--megarl-test--tiny-llama-digits/snapshots/{COMMIT_B}" (does not change results)' in proc.stdout
    assert json.loads((run_dir / "config_history" / "step_00000003.json").read_text())["hub.model.path.revision"] == COMMIT_B

    # export with no --model: the run's model.path at the commit its last segment recorded (offline)
    exported = torchrun(0, ["-m", "megarl.tools.export_hf", "--ckpt", str(run_dir / "checkpoints" / "step_00000002"),
                            "--out", str(tmp_path / "export")], timeout=600, env=env)
    assert "wrote" in exported.stdout
    assert json.loads((tmp_path / "export" / "config.json").read_text())["hidden_size"] == TINY["hidden"]
    assert (tmp_path / "export" / "tokenizer.json").read_text() == (model / "tokenizer.json").read_text()
