"""The dashboard and the rules against a real Prometheus scraping a real fleet under load
(bench/observe.py): every panel query returns data in range, a killed worker shows in the
error and health panels and fires the worker-down alert, the gateway's latency quantiles match
the client's within a histogram bucket, and every recording rule returns values in range.

Needs Debian's `prometheus` (installed here when missing and running as root)."""

import shutil

import pytest

from bench import observe
from tests.test_deploy import need_prometheus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    need_prometheus()
    return observe.run(duration_s=16.0, kill_at_s=7.0, concurrency=2, logs=str(tmp_path_factory.mktemp("observe")))


def test_every_panel_query_returns_data_in_range(report):
    assert report["panels"], "the dashboard has panels"
    problems = [p for p in report["problems"] if " / " in p]
    assert not problems, problems
    assert all(e["points"] > 0 for e in report["panels"])


def test_a_killed_worker_shows_in_the_error_and_health_panels_and_fires_an_alert(report):
    assert not [p for p in report["problems"] if "killed" in p or "never fired" in p], report["problems"]
    errors = [e for e in report["panels"] if e["panel"] == observe.ERROR_PANEL and "stage" in e["legend"]]
    killed = report["window"]["killed"]
    failures = {
        s["metric"]["stage"]
        for e in errors
        for s in e["result"]
        if s["metric"].get("worker") == "m1" and any(float(t) > killed and float(v) > 0 for t, v in s["values"])
    }
    assert failures, "the killed worker's failures show by stage"
    assert "m1" in report["rules"]["worker_down_fired_for"]


def test_gateway_latency_quantiles_match_the_clients(report):
    assert len(report["latency"]) == 3 and all(r["client_requests"] > 20 for r in report["latency"])
    assert not [p for p in report["problems"] if "Prometheus" in p], report["problems"]


def test_recording_rules_and_alerts_evaluate_in_range(report):
    assert not [p for p in report["problems"] if "rule" in p or "alert" in p], report["problems"]
    assert set(report["rules"]["records"]) == {
        "kvgate:slo_attainment:ratio_rate5m",
        "kvgate:goodput:rate5m",
        "kvgate:prefix_hit:ratio_rate5m",
        "kvgate:prefix_hit_predicted:ratio_rate5m",
        "kvgate:error:ratio_rate5m",
    }
    assert len(report["rules"]["alerts"]) == 8


def test_no_problem_at_all_and_the_panels_render(report, tmp_path):
    assert report["problems"] == []
    png = tmp_path / "dashboard.png"
    observe.plot(report, str(png))
    assert png.stat().st_size > 50_000 and shutil.which("promtool")
