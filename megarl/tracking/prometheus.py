"""Live metrics for Prometheus: rank 0 serves `/metrics` (tracking.prometheus_port).

Every step metric of metrics.jsonl becomes a gauge named `megarl_` + its name with each character
outside [a-zA-Z0-9_] replaced by `_` (`critic/score/mean` -> `megarl_critic_score_mean`,
`timing_s/gen` -> `megarl_timing_s_gen`); its HELP line gives the original name. Beside them:
`megarl_step` (the last step logged), `megarl_guard_firings_total{guard=...}` (a counter; it
restarts at 0 in a resumed process, which `rate()`/`increase()` handle) and the process collector's
`process_resident_memory_bytes`, `process_cpu_seconds_total`, ... docs/grafana-dashboard.json
charts them; docs/operations.md says how to scrape.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

from megarl.tracking.deps import require

PREFIX = "megarl_"
GUARDS = ("kl", "nan", "reward_collapse")  # megarl/guards.py's events, guard/<name>: each label exists from the start


def prometheus_name(metric: str) -> str:
    """The gauge a step metric is served as: megarl_ + the name with [^a-zA-Z0-9_] -> _."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", metric)


class PrometheusExporter:
    """The /metrics endpoint on host:port (port 0: any free port; `port` holds the bound one)."""

    def __init__(self, host: str, port: int):
        require("prometheus_client", "prometheus-client", "tracking.prometheus_port")
        from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, start_http_server

        self._Gauge = Gauge
        self.registry = CollectorRegistry()  # our own: nothing else in the process leaks into /metrics
        ProcessCollector(registry=self.registry)
        self.step = Gauge(PREFIX + "step", "the last PPO step logged", registry=self.registry)
        self.guards = Counter(PREFIX + "guard_firings", "guard firings by guard (megarl/guards.py)", ["guard"],
                              registry=self.registry)
        for guard in GUARDS:
            self.guards.labels(guard)
        self.gauges: dict[str, Any] = {}
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        self.host, self.port = host, self.server.server_port

    def log(self, values: Mapping[str, float | None], step: int) -> None:
        for metric, value in values.items():
            self._gauge(metric).set(math.nan if value is None else value)
        self.step.set(step)  # last: a scrape that sees the new step sees its metrics too

    def event(self, name: str, step: int, fields: Mapping[str, Any]) -> None:
        if name.startswith("guard/"):
            self.guards.labels(name.removeprefix("guard/")).inc()

    def close(self, status: str) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _gauge(self, metric: str):
        gauge = self.gauges.get(metric)
        if gauge is None:
            gauge = self.gauges[metric] = self._Gauge(prometheus_name(metric), f"{metric} (the step metric of metrics.jsonl)",
                                                      registry=self.registry)
        return gauge
