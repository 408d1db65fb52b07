"""deploy/grafana/mlxd-dashboard.json queries only metrics a live mlxd exposes, and has
panels for the web UI's figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "mlxd-dashboard.json"
# a metric name in PromQL: mlxd's colon names and the process collector's
_NAME = re.compile(r"\b(mlxd:[a-z0-9_:]+|process_[a-z0-9_]+)\b")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("_sum", "_count", "_created"),
}


def exprs(dashboard: dict) -> list[str]:
    out = [v["query"] for v in dashboard["templating"]["list"]]
    for panel in dashboard["panels"]:
        out += [t["expr"] for t in panel["targets"]]
    return out


def exposed_names(text: str) -> set[str]:
    """Every sample name the exposition can carry, from its families' types (a labelled
    family without samples yet still names its type)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        for suffix in _SUFFIXES.get(fam.type, ("",)):
            names.add(fam.name + suffix)
        names.update(s.name for s in fam.samples)
    return names


def test_every_metric_the_dashboard_queries_exists(server):
    with server.client() as c:  # traffic, so that the per-model families have samples
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200
        text = c.get("/metrics").text
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {n for e in exprs(dashboard) for n in _NAME.findall(e)}
    assert len(queried) >= 15, queried
    missing = queried - exposed_names(text)
    assert not missing, f"the dashboard queries metrics mlxd does not expose: {missing}"


def test_the_dashboard_has_the_web_uis_figures():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "Tokens/s",
        "Time to first token",
        "Queue depth",
        "Requests by status",
        "Memory",
    } <= titles
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["job", "model"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
