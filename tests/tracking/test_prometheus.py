"""The live metrics endpoint (megarl.tracking.prometheus) in process: names, values, promtool."""
from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from prometheus_helpers import dashboard_exprs, dashboard_metric_names, fetch, promtool_check_metrics
from megarl.config import TrackingConfig
from megarl.tracking import Tracker
from megarl.tracking.prometheus import prometheus_name


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_step_metrics_are_served_under_their_prometheus_names_and_promtool_accepts_them(tmp_path):
    tracker = Tracker(TrackingConfig(loggers=["jsonl"], prometheus_port=0), tmp_path)
    exporter = tracker.prometheus
    assert exporter.server.server_address[0] == "127.0.0.1"  # localhost unless tracking.prometheus_host says otherwise
    tracker.log({"critic/score/mean": 0.75, "timing_s/gen": 2.5, "perf/rollout_tokens_per_s_per_gpu": 512.0,
                 "perf/cpu_rss_gb": 1.5,
                 "actor/grad_norm": float("inf"), "fleet/lost_total": 1.0, "fleet/joined_total": 2.0}, 7)
    tracker.log({"fleet/lost_total": 1.0, "fleet/joined_total": 3.0}, 8)  # running totals: served as counters
    tracker.event("guard/kl", 7, kl=3.0)
    tracker.event("guard/kl", 7, kl=3.0)
    text = fetch(f"http://127.0.0.1:{exporter.port}/metrics")
    samples = _samples(text)
    assert samples[("megarl_step", ())] == 8
    assert samples[("megarl_fleet_lost_total", ())] == 1 and samples[("megarl_fleet_joined_total", ())] == 3
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert types["megarl_fleet_lost"] == types["megarl_fleet_joined"] == "counter"  # the parser drops _total
    assert samples[("megarl_critic_score_mean", ())] == 0.75
    assert samples[("megarl_timing_seconds_gen", ())] == 2.5
    assert samples[("megarl_perf_rollout_tokens_per_second_per_gpu", ())] == 512.0
    assert samples[("megarl_perf_cpu_rss_bytes", ())] == 1.5 * 2**30
    assert math.isnan(samples[("megarl_actor_grad_norm", ())])  # non-finite: null in metrics.jsonl, NaN here
    assert samples[("megarl_guard_firings_total", (("guard", "kl"),))] == 2
    assert samples[("megarl_guard_firings_total", (("guard", "nan"),))] == 0
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert "# HELP megarl_critic_score_mean critic/score/mean (the step metric of metrics.jsonl)" in text
    check = promtool_check_metrics(text)
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr
    tracker.close()


def test_prometheus_names_and_the_dashboard_queries():
    assert prometheus_name("critic/score/mean") == "megarl_critic_score_mean"
    assert prometheus_name("memory/resident_gb/update_actor") == "megarl_memory_resident_bytes_update_actor"
    assert prometheus_name("timing_s/step") == "megarl_timing_seconds_step"
    names = dashboard_metric_names()
    # every panel has a query; the names are found (the real-server test checks each one is served)
    assert all(dashboard_exprs()) and {"megarl_step", "megarl_perf_rollout_tokens_per_second_per_gpu",
                                       "megarl_guard_firings_total", "process_resident_memory_bytes"} <= names
    assert not any(w in names for w in ("increase", "guard", "10m"))


def test_a_busy_port_is_one_line_naming_the_key(tmp_path):
    import pytest

    first = Tracker(TrackingConfig(loggers=[], prometheus_port=0), tmp_path / "a")
    port = first.prometheus.port
    with pytest.raises(ValueError, match=rf"^tracking.prometheus_port={port}: cannot serve metrics on 127.0.0.1:{port} "
                                         r"\(Address already in use\); choose a free port"):
        Tracker(TrackingConfig(loggers=[], prometheus_port=port), tmp_path / "b")
    first.close()
