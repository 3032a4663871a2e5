"""metrics.jsonl, MLflow without a server, events, resume (megarl.tracking)."""
from __future__ import annotations

import json

from megarl.config import TrackingConfig, flatten, load_config
from megarl.tracking import METRICS_FILE, Tracker, default_tracking_uri

BASE = ["model.path=/tmp/model", "data.train_files=[/tmp/train.parquet]"]


def _lines(run_dir):
    return [json.loads(ln) for ln in (run_dir / METRICS_FILE).read_text().splitlines()]


def _fake_step(step):
    return {"critic/score/mean": 0.1 * step, "actor/pg_loss": -0.01 * step, "actor/ppo_kl": 0.001}


def test_fake_run_is_found_by_mlflow_search_runs_and_resumes_into_the_same_run(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)  # a store created in the working directory by mistake would show here

    run_dir = tmp_path / "run"
    cfg = load_config(None, BASE + [f"trainer.run_dir={run_dir}", "tracking.experiment=megarl-test"])
    params = flatten(cfg)
    tracker = Tracker(cfg.tracking, run_dir, total_steps=5, params=params)
    for step in (1, 2, 3):
        tracker.log(_fake_step(step), step)
    tracker.event("kl_guard", 3, kl=2.5, action="raise_coef")
    tracker.close()
    first_id = tracker.run_id

    # Resume from a checkpoint at step 2: step 3 is logged again, once.
    tracker = Tracker(cfg.tracking, run_dir, total_steps=5, start_step=3, resume=True, params=params)
    assert tracker.run_id == first_id
    for step in (3, 4, 5):
        tracker.log(_fake_step(step), step)
    tracker.close()

    lines = _lines(run_dir)
    assert [ln["step"] for ln in lines] == [1, 2, 3, 4, 5]
    assert lines[0] == {"step": 1, **_fake_step(1)}

    mlflow.set_tracking_uri(default_tracking_uri(run_dir))
    runs = mlflow.search_runs(experiment_names=["megarl-test"], output_format="list")
    assert [r.info.run_id for r in runs] == [first_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["actor.optim.lr"] == "1e-06" and run.data.params["rollout.engine"] == "hf"
    assert run.data.metrics["critic/score/mean"] == 0.5  # latest value
    assert "event/kl_guard/step_3" in run.data.tags
    history = mlflow.MlflowClient(default_tracking_uri(run_dir)).get_metric_history(first_id, "critic/score/mean")
    assert sorted({m.step for m in history}) == [1, 2, 3, 4, 5]
    assert (run_dir / "mlflow.db").exists()
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()


def test_jsonl_only_and_non_zero_ranks(tmp_path):
    cfg = TrackingConfig(mlflow=False, progress_bar=False)
    quiet = Tracker(cfg, tmp_path / "r", rank=1)
    quiet.log({"x": 1.0}, 1)
    quiet.event("e", 1)
    quiet.close()
    assert not (tmp_path / "r").exists()

    tracker = Tracker(cfg, tmp_path / "r")
    tracker.log({"a": 1, "nan": float("nan")}, 1)
    tracker.event("grad_norm_guard", 1, grad_norm=1e9)
    tracker.close()
    assert _lines(tmp_path / "r") == [{"step": 1, "a": 1.0, "nan": None},
                                      {"step": 1, "event": "grad_norm_guard", "grad_norm": 1e9}]

    # A line cut short by a crash is dropped on restart.
    with open(tmp_path / "r" / METRICS_FILE, "a") as f:
        f.write('{"step": 2, "a": 1.')
    Tracker(cfg, tmp_path / "r", start_step=2).close()
    assert len(_lines(tmp_path / "r")) == 2

    # A fresh (not resumed) start in the same directory begins the file again.
    tracker = Tracker(cfg, tmp_path / "r", start_step=0)
    tracker.log({"a": 2.0}, 1)
    tracker.close()
    assert _lines(tmp_path / "r") == [{"step": 1, "a": 2.0}]


def test_steps_re_run_after_a_resume_leave_one_mlflow_point_each(tmp_path):
    # Issue 11, item 9: metrics.jsonl dropped the re-run steps, MLflow kept both points of each.
    import mlflow

    run_dir = tmp_path / "run"
    cfg = load_config(None, BASE + [f"trainer.run_dir={run_dir}", "tracking.experiment=megarl-dup",
                                    "tracking.progress_bar=false"])
    tracker = Tracker(cfg.tracking, run_dir, total_steps=4, params=flatten(cfg))
    for step in (1, 2, 3, 4):
        tracker.log({"critic/score/mean": float(step)}, step)
    tracker.event("kl_guard", 4, kl=2.5)
    tracker.close("KILLED")
    tracker = Tracker(cfg.tracking, run_dir, total_steps=4, start_step=3, resume=True, params=flatten(cfg))
    for step in (3, 4):
        tracker.log({"critic/score/mean": 10.0 * step}, step)
    tracker.close()

    client = mlflow.MlflowClient(default_tracking_uri(run_dir))
    history = sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, "critic/score/mean"))
    assert history == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    metrics = client.get_run(tracker.run_id).data.metrics
    assert metrics["critic/score/mean"] == 40.0 and "events/kl_guard" not in metrics  # the abandoned step's event
    assert [ln["step"] for ln in _lines(run_dir)] == [1, 2, 3, 4]


def test_sample_ids_file_keeps_the_steps_before_a_resume(tmp_path):
    """tracking.sample_ids: samples.jsonl gets one line per step; a resume at step 3 drops what a
    killed process logged at step 3 or later (and a line the kill cut short), as metrics.jsonl."""
    from megarl.data.dataset import PromptRow
    from megarl.step.samples import Sample, id_records, merge_id_records

    def sample(row, prompt, index, versions):
        return Sample(PromptRow(prompt, row, "p", "g", "d"), index, [5], [0.0], True, "t", versions=versions)

    # two ranks of one model-parallel group hold the same samples; another DP rank holds prompt 0
    mine = id_records([sample(17, 1, 1, (2, 3)), sample(17, 1, 0, None)])
    other = id_records([sample(4, 0, 0, (3,))])
    records = merge_id_records([mine, mine, other])
    assert records == [[4, 0, 0, [3]], [17, 1, 0, None], [17, 1, 1, [2, 3]]]

    cfg = TrackingConfig(mlflow=False, progress_bar=False, sample_ids=True)
    tracker = Tracker(cfg, tmp_path / "r")
    for step in (1, 2, 3):
        tracker.samples(step, records[:step])
    tracker.close()
    with open(tmp_path / "r" / "samples.jsonl", "a") as f:
        f.write('{"step": 4, "samples": [[1, ')
    Tracker(cfg, tmp_path / "r", start_step=3).close()
    lines = [json.loads(line) for line in (tmp_path / "r" / "samples.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "samples": records[:1]}, {"step": 2, "samples": records[:2]}]
    Tracker(TrackingConfig(mlflow=False, progress_bar=False), tmp_path / "q").close()
    assert not (tmp_path / "q" / "samples.jsonl").exists()  # off by default
