"""A short CPU run watched the way users watch one (issue 27): every logger on, a real Prometheus
server scraping the live endpoint, one step profiled; then a resume that re-runs a step.

TensorBoard (EventAccumulator) and the offline W&B run (its .wandb file) hold exactly the values of
metrics.jsonl at every step, before and after the resume; Prometheus answers PromQL with values
of the run and knows every metric the Grafana dashboard charts; the profiled step's Chrome trace
names every phase of ppo_step.
"""
from __future__ import annotations

import json
import shutil
import sys
import threading
import time

import pytest

from conftest import REPO, free_port
from logger_files import jsonl_rows, tensorboard_scalars, wandb_history
from megarl.runtime.profiling import trace_path
from megarl.tracking import read_metrics_file
from prometheus_helpers import PrometheusServer, dashboard_metric_names, fetch, need, promtool_check_metrics

sys.path.insert(0, str(REPO / "tests" / "trainer"))
from ppo_helpers import launch_ok, small_run_overrides  # noqa: E402

pytestmark = [pytest.mark.slow]

PHASES = ("sync", "gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic", "update_actor")



def _assert_same(expected: dict, got: dict, name: str, rel: float):
    assert sorted(got) == sorted(expected), f"{name}: steps {sorted(got)}, metrics.jsonl {sorted(expected)}"
    for step, row in expected.items():
        assert sorted(got[step]) == sorted(row), f"{name} step {step}: names differ: {set(got[step]) ^ set(row)}"
        for key, value in row.items():
            assert got[step][key] == pytest.approx(value, rel=rel, abs=1e-30), f"{name} step {step} {key}"


class _Scraper(threading.Thread):
    """Keeps the endpoint's latest text once it shows a step (for promtool)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.text, self.done = url, None, False

    def run(self):
        while not self.done:
            try:
                text = fetch(self.url, timeout=2)
                if "\nmegarl_critic_score_mean " in text:
                    self.text = text
            except OSError:
                pass
            time.sleep(0.5)


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("watched")
    run_dir, port = root / "run", free_port()
    # Without Debian's prometheus (make monitor-deps) only the Prometheus test skips.
    server = PrometheusServer(root / "prometheus", free_port(), [f"127.0.0.1:{port}"]) if shutil.which("prometheus") else None
    overrides = small_run_overrides(root, run_dir, **{
        "trainer.total_steps": 3, "trainer.save_every_steps": 2, "trainer.val_every_steps": 1,
        "algorithm.use_kl_in_reward": "true",  # the reference model's phase too
        "actor.optim.schedule": "constant", "critic.optim.schedule": "constant",
        "tracking.loggers": "[console,jsonl,mlflow,tensorboard,wandb]", "tracking.prometheus_port": port,
        "trainer.profile_steps": "[2]"})
    scraper = _Scraper(f"http://127.0.0.1:{port}/metrics")
    scraper.start()
    try:
        launch_ok(0, overrides)
        time.sleep(1)  # the last scrape of the finished run reaches the TSDB head
        scraper.done = True
        first = {"jsonl": jsonl_rows(run_dir), "tensorboard": tensorboard_scalars(run_dir), "wandb": wandb_history(run_dir)}
        queries = ("max_over_time(megarl_step[1h])", "last_over_time(megarl_critic_score_mean[1h])")
        promql = {q: server.query(q) for q in queries} if server else None
        names = server.metric_names() if server else None
    finally:
        scraper.done = True
        if server:
            server.stop()
    # Resume from the step-2 checkpoint: step 3 runs again.
    resumed = launch_ok(0, overrides[:-2] + [f"trainer.resume={run_dir / 'checkpoints' / 'step_00000002'}"])
    return dict(run_dir=run_dir, first=first, promql=promql, names=names, text=scraper.text, resumed=resumed.stdout)


def test_tensorboard_and_wandb_equal_metrics_jsonl_at_every_step(watched_run):
    first = watched_run["first"]
    assert sorted(first["jsonl"]) == [1, 2, 3] and "critic/score/mean" in first["jsonl"][3]
    _assert_same(first["jsonl"], first["tensorboard"], "tensorboard", rel=1e-6)  # float32 scalars
    _assert_same(first["jsonl"], first["wandb"], "wandb", rel=0)


def test_a_resumed_run_has_no_step_twice_in_any_logger(watched_run):
    run_dir = watched_run["run_dir"]
    assert "resumed from" in watched_run["resumed"] and "step_00000002" in watched_run["resumed"]
    steps = [r["step"] for r in read_metrics_file(run_dir / "metrics.jsonl") if "event" not in r]
    assert steps == [1, 2, 3]
    rows = jsonl_rows(run_dir)
    _assert_same(rows, tensorboard_scalars(run_dir), "tensorboard", rel=1e-6)
    _assert_same(rows, wandb_history(run_dir), "wandb", rel=0)  # asserts one offline directory
    # the re-run step 3 is the resumed process's: its timing differs from the first run's
    assert rows[3]["timing_s/step"] != watched_run["first"]["jsonl"][3]["timing_s/step"]

    import mlflow

    from megarl.tracking import default_tracking_uri
    client = mlflow.MlflowClient(default_tracking_uri(run_dir))
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    assert sorted(m.step for m in client.get_metric_history(run_id, "critic/score/mean")) == [1, 2, 3]


def test_a_real_prometheus_scraped_the_run_and_the_dashboard_names_served_metrics(watched_run):
    need("prometheus"), need("promtool")
    rows = watched_run["first"]["jsonl"]
    (step,) = watched_run["promql"]["max_over_time(megarl_step[1h])"]
    assert float(step["value"][1]) in (1.0, 2.0, 3.0)
    (score,) = watched_run["promql"]["last_over_time(megarl_critic_score_mean[1h])"]
    assert float(score["value"][1]) in [rows[s]["critic/score/mean"] for s in rows]
    missing = dashboard_metric_names() - watched_run["names"]
    assert not missing, f"the dashboard charts metrics the run does not serve: {sorted(missing)}"
    assert watched_run["text"] is not None
    check = promtool_check_metrics(watched_run["text"])
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_profiled_step_names_every_phase_of_ppo_step(watched_run):
    run_dir = watched_run["run_dir"]
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["step_00000002"]  # that step only
    trace = json.loads(trace_path(run_dir, 2, 0).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {f"ppo_step/{p}" for p in PHASES} | {"ppo_step 2", "sync/bucket_0"} <= names


def test_the_report_of_the_run_draws_its_metrics_file(watched_run, tmp_path):
    from megarl.tools.report import build_report

    run_dir = watched_run["run_dir"]
    drawn = build_report([run_dir], tmp_path / "report.html")
    rows = [r for r in read_metrics_file(run_dir / "metrics.jsonl") if "event" not in r]
    label = run_dir.name
    for png, metric in (("report_score.png", "critic/score/mean"), ("report_score.png", "val/score/mean"),
                        ("report_kl_coef.png", "actor/reward_kl_penalty_coeff"), ("report_entropy.png", "actor/entropy"),
                        ("report_losses.png", "critic/vf_loss"), ("report_grad_norms.png", "actor/grad_norm"),
                        ("report_response_length.png", "response_length/mean"), ("report_memory.png", "perf/cpu_rss_gb")):
        assert drawn[png][label][metric] == ([r["step"] for r in rows], [r[metric] for r in rows]), (png, metric)
    shares = drawn["report_phase_share.png"][label]
    assert set(shares) == {f"timing_s/{p}" for p in PHASES}
    assert shares["timing_s/gen"][1] == [r["timing_s/gen"] / r["timing_s/step"] for r in rows]
