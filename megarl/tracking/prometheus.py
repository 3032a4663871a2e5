"""Live metrics for Prometheus: rank 0 serves `/metrics` (tracking.prometheus_port).

Every step metric of metrics.jsonl becomes a gauge named `megarl_` + its name with each character
outside [a-zA-Z0-9_] replaced by `_` and abbreviated units spelled out as Prometheus wants them
(`critic/score/mean` -> `megarl_critic_score_mean`, `timing_s/gen` -> `megarl_timing_seconds_gen`,
`perf/cpu_rss_gb` -> `megarl_perf_cpu_rss_bytes`, its value in bytes); its HELP line gives the
original name (and the factor, where the unit changed). A step metric whose name ends in `_total` is
a running total (`fleet/lost_total`, `fleet/joined_total`, ...) and is served as a counter of the same
name (promtool: a gauge must not end in _total); like every counter here it restarts at 0 in a
new process. Beside them:
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
GUARDS = ("kl", "nan", "reward_collapse")  # megarl/step/guards.py's events, guard/<name>: each label exists from the start


# Prometheus wants base units spelled out (promtool: "metric names should not contain abbreviated
# units"): a name part that is a unit becomes the base unit, and the value is scaled to it.
UNITS = {"s": ("seconds", 1.0), "ms": ("seconds", 1e-3), "gb": ("bytes", 2.0**30), "mb": ("bytes", 2.0**20)}


def served_as(metric: str) -> tuple[str, float]:
    """(gauge name, factor from the metric's value to the gauge's) of a step metric: megarl_ + the
    name with [^a-zA-Z0-9_] -> _ and units spelled out: timing_s/gen -> megarl_timing_seconds_gen,
    perf/cpu_rss_gb -> megarl_perf_cpu_rss_bytes (x 2**30), perf/samples_per_s -> megarl_perf_samples_per_second."""
    parts, scale = [], 1.0
    for part in re.sub(r"[^a-zA-Z0-9_]", "_", metric).split("_"):
        unit, factor = UNITS.get(part.lower(), (part, 1.0))
        parts.append("second" if unit == "seconds" and parts[-1:] == ["per"] else unit)  # tokens_per_second
        scale *= factor
    return PREFIX + "_".join(parts), scale


def prometheus_name(metric: str) -> str:
    """The gauge a step metric is served as (see served_as)."""
    return served_as(metric)[0]


class PrometheusExporter:
    """The /metrics endpoint on host:port (port 0: any free port; `port` holds the bound one)."""

    def __init__(self, host: str, port: int):
        require("prometheus_client", "prometheus-client", "tracking.prometheus_port")
        # deferred: optional (prometheus_client, monitor extra)
        from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, start_http_server

        self._Gauge, self._Counter = Gauge, Counter
        self.registry = CollectorRegistry()  # our own: nothing else in the process leaks into /metrics
        ProcessCollector(registry=self.registry)
        self.step = Gauge(PREFIX + "step", "the last PPO step logged", registry=self.registry)
        self.guards = Counter(PREFIX + "guard_firings", "guard firings by guard (megarl/step/guards.py)", ["guard"],
                              registry=self.registry)
        for guard in GUARDS:
            self.guards.labels(guard)
        self.gauges: dict[str, Any] = {}
        self.counters: dict[str, list] = {}  # a _total step metric -> [its Counter, the total it has counted]
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise ValueError(f"tracking.prometheus_port={port}: cannot serve metrics on {host}:{port} "
                             f"({err.strerror or err}); choose a free port (0 picks one) or another tracking.prometheus_host") from None
        self.host, self.port = host, self.server.server_port

    def log(self, values: Mapping[str, float | None], step: int) -> None:
        for metric, value in values.items():
            if metric.endswith("_total"):
                self._count(metric, value)
                continue
            gauge, scale = self._gauge(metric)
            gauge.set(math.nan if value is None else value * scale)
        self.step.set(step)  # last: a scrape that sees the new step sees its metrics too

    def event(self, name: str, step: int, fields: Mapping[str, Any]) -> None:
        if name.startswith("guard/"):
            self.guards.labels(name.removeprefix("guard/")).inc()

    def close(self, status: str) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _gauge(self, metric: str):
        entry = self.gauges.get(metric)
        if entry is None:
            name, scale = served_as(metric)
            help_text = f"{metric} (the step metric of metrics.jsonl)" + (f" x {scale:g}" if scale != 1.0 else "")
            entry = self.gauges[metric] = (self._Gauge(name, help_text, registry=self.registry), scale)
        return entry

    def _count(self, metric: str, total: float | None) -> None:
        """A running total's counter follows it (a counter only goes up: a total that fell, or none, is
        not counted)."""
        entry = self.counters.get(metric)
        if entry is None:
            name, _ = served_as(metric)
            entry = self.counters[metric] = [self._Counter(name, f"{metric} (the running total of metrics.jsonl)",
                                                           registry=self.registry), 0.0]
        if total is not None and math.isfinite(total) and total > entry[1]:
            entry[0].inc(total - entry[1])
            entry[1] = total
