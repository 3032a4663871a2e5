"""A real Prometheus server (Debian's `prometheus`, installed by `make monitor-deps`) for the tests,
promtool, and the metric names the Grafana dashboard's queries use."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO

DASHBOARD = REPO / "docs" / "grafana-dashboard.json"
# PromQL words that are not metric names (functions, aggregations, keywords) the dashboard may use.
PROMQL_WORDS = {"rate", "irate", "increase", "sum", "avg", "max", "min", "by", "without", "max_over_time",
                "avg_over_time", "last_over_time", "on", "ignoring", "and", "or", "unless", "offset"}


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"needs {binary} (Debian's prometheus package: make monitor-deps)")
    return path


FLEET_ROW = "Fleet (rollout.placement=fleet)"  # its panels chart what only a fleet run serves


def dashboard_exprs(row: str | None = None) -> list[str]:
    """The queries of the dashboard's panels; with `row`, of the panels under that row only, and
    without, of the panels outside the fleet row (what every run serves)."""
    exprs, current = [], None
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            current = panel["title"]
            continue
        if current == row or (row is None and current != FLEET_ROW):
            exprs += [t["expr"] for t in panel["targets"]]
    return exprs


def dashboard_metric_names(row: str | None = None) -> set[str]:
    """The metric names the dashboard's queries read (label names, label values, ranges removed)."""
    names = set()
    for expr in dashboard_exprs(row):
        bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
        names |= {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare) if w not in PROMQL_WORDS}
    return names


def fetch(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([need("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


class PrometheusServer:
    """`prometheus` scraping `targets` every second, its data and config under `root`."""

    def __init__(self, root: Path, web_port: int, targets: list[str]):
        binary = need("prometheus")
        root.mkdir(parents=True, exist_ok=True)
        config = root / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "megarl", "static_configs": [{"targets": targets}]}]}))
        self.url = f"http://127.0.0.1:{web_port}"
        self.log = open(root / "prometheus.log", "w")
        self.proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{web_port}"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            try:
                if "Ready" in fetch(self.url + "/-/ready"):
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"prometheus did not start: {(root / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def query(self, promql: str) -> list[dict]:
        """An instant PromQL query over the HTTP API: the result vector."""
        answer = json.loads(fetch(self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def metric_names(self) -> set[str]:
        return set(json.loads(fetch(self.url + "/api/v1/label/__name__/values"))["data"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()
