"""The Grafana dashboard and Prometheus scrape config in deploy/ (issue 17): the dashboard is well-formed
Grafana JSON, and every series it queries is one the gateway exports, with the suffix its type gets in the
exposition format and only labels that series has."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from pdserve.server.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())


def exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every series name the gateway's /metrics can carry -> (its metric family, its labels)."""
    series = {}
    for m in vars(Metrics()).values():
        if isinstance(m, MetricWrapperBase):
            for suffix in SUFFIXES[m._type]:
                series[m._name + suffix] = m._name, tuple(m._labelnames) + (("le",) if suffix == "_bucket" else ())
    return series


def graph_panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_is_well_formed_grafana_json(dashboard):
    assert dashboard["uid"] == "pdserve" and isinstance(dashboard["schemaVersion"], int)
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and 0 <= g["x"] and g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
    for p in graph_panels(dashboard):
        assert p["type"] == "timeseries" and p["title"] and p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_every_series_the_dashboard_queries_is_exported_with_its_labels(dashboard):
    series = exported()
    used = set()
    for p in graph_panels(dashboard):
        for t in p["targets"]:
            expr = t["expr"]
            names = re.findall(r"\bpdserve_[a-z0-9_]+", expr)
            assert names, expr
            for name in names:
                assert name in series, f"{p['title']!r} queries {name}, which the gateway does not export"
            labels = {label for name in names for label in series[name][1]}
            grouped = {g.strip() for by in re.findall(r"by \(([^)]*)\)", expr) for g in by.split(",")}
            assert grouped <= labels, f"{p['title']!r} groups by {grouped - labels}, labels of none of {names}"
            legend = set(re.findall(r"\{\{(\w+)\}\}", t.get("legendFormat", "")))
            assert legend <= labels, f"{p['title']!r} names {legend - labels} in its legend"
            used |= {series[name][0] for name in names}
    assert {family for family, _ in series.values()} - used == set(), "exported but on no panel"


def test_prometheus_scrape_config_points_at_metrics():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
