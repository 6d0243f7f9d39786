"""The dashboard only charts metrics that the gateway and workers really export."""

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.sim_engine import drain, sim_engine
from workers.metrics import WorkerMetrics
from workers.sampling_params import SamplingParams
from workers.transfer_http import TransferService
from workers.transfer_metrics import TransferCollector

ROOT = Path(__file__).resolve().parent.parent


def exported_names() -> set[str]:
    from gateway.fleet import Fleet
    from gateway.index import ResidencyIndex
    from gateway.metrics import GatewayMetrics, RedisCollector
    from gateway.redis_state import RedisState

    eng = sim_engine()
    eng.submit("r", [3, 4, 5], SamplingParams(max_tokens=2), lambda o: None)
    drain(eng)
    worker = WorkerMetrics(eng)
    worker.registry.register(TransferCollector(TransferService(eng, "m", None), "m"))
    fleet = Fleet(ResidencyIndex())
    gateway = GatewayMetrics(fleet)
    gateway.registry.register(RedisCollector(RedisState("redis://127.0.0.1:1/0", fleet, "t")))
    texts = [worker.render()[0].decode(), gateway.render()[0].decode()]
    names = set()
    for text in texts:
        for fam in text_string_to_metric_families(text):
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(fam.type, ("",))
            names |= {fam.name + suffix for suffix in suffixes}
    return names


def test_dashboard_queries_name_exported_metrics():
    dash = json.loads((ROOT / "grafana/dashboards/kvgate.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"kvgate_[a-z0-9_]+", e)}
    assert used, "the dashboard charts something"
    missing = used - exported_names()
    assert not missing, f"dashboard uses metrics nobody exports: {sorted(missing)}"


def test_dashboard_has_the_operator_panels_and_variables():
    dash = json.loads((ROOT / "grafana/dashboards/kvgate.json").read_text())
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"datasource", "model", "worker", "gateway"}
    titles = {p["title"] for p in dash["panels"]}
    for wanted in (
        "SLO attainment",
        "Goodput",
        "Routing quality per worker: predicted vs actual hit ratio",
        "Routing quality per policy: predicted vs actual hit ratio",
        "Residency index lag",
        "Errors/s",
    ):
        assert wanted in titles
    for p in dash["panels"]:
        assert p["description"] and p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            if "kvgate_worker_" in t["expr"]:
                assert 'worker=~"$worker"' in t["expr"], (p["title"], t["expr"])
            if "kvgate_gateway_" in t["expr"] and "model" not in t["expr"]:
                assert 'instance=~"$gateway"' in t["expr"], (p["title"], t["expr"])
