"""The Prometheus alert rules in deploy/prometheus/ (issue 40 item 5): the file parses as Prometheus rule groups,
the scrape config loads it, and every series an alert's expression reads is one the gateway exports (with the
suffix its type gets in the exposition format). promtool is not needed: the YAML is parsed here."""

from __future__ import annotations

import re

import pytest

from test_dashboard import DEPLOY, exported

yaml = pytest.importorskip("yaml")
RULES = DEPLOY / "prometheus" / "pdserve-alerts.yml"


def _rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert groups and all(g["name"] and g["rules"] for g in groups)
    return [r for g in groups for r in g["rules"]]


def test_the_scrape_config_loads_the_alert_rules():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert [(DEPLOY / "prometheus" / f).resolve() for f in config["rule_files"]] == [RULES.resolve()]


def test_every_alert_is_well_formed_and_reads_exported_series():
    series = exported()
    rules = _rules()
    assert {r["alert"] for r in rules} == {"PdserveKvRecomputeShareHigh"}
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
        assert re.fullmatch(r"\d+[smh]", rule["for"]) and rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), expr
        names = re.findall(r"\bpdserve_[a-z0-9_]+", expr)
        assert names and all(n in series for n in names), (names, expr)


def test_the_recompute_alert_is_the_recomputed_share_of_prompt_tokens_over_ten_minutes():
    (rule,) = [r for r in _rules() if r["alert"] == "PdserveKvRecomputeShareHigh"]
    expr = " ".join(rule["expr"].split())
    assert expr == ("sum(rate(pdserve_kv_recomputed_tokens_total[10m])) / sum(rate(pdserve_prompt_tokens_total[10m]))"
                    " > 0.05")
