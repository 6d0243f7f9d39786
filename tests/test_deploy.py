"""The deploy folder, validated offline: Prometheus configs and rules by promtool (rules also
unit-tested with `promtool test rules`), the Kubernetes manifests against the API schemas
(kubernetes-validate), and the compose stack's commands, mounts and scrape targets against
what kvgate and the repository actually have."""

import os
import shlex
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from bench.prom import PrometheusMissing, ensure_prometheus
from gateway.cli_args import parser as gateway_parser
from tests.test_grafana import exported_names
from workers.cli import parser as worker_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"
K8S_VERSION = "1.30.0"


def need_prometheus() -> None:
    """Install Debian's prometheus when missing (as root, like CI); skip for anyone else without it."""
    try:
        ensure_prometheus()
    except PrometheusMissing as e:
        if os.geteuid() == 0:
            raise
        pytest.skip(str(e))


def promtool(*args: str, cwd: Path = PROM) -> None:
    need_prometheus()
    out = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("config", ["prometheus.yml", "kubernetes.yml"])
def test_prometheus_configs_are_valid(config):
    promtool("check", "config", config)


def test_rules_are_valid_and_their_unit_tests_pass():
    promtool("check", "rules", "rules.yml")
    promtool("test", "rules", "rules_test.yml")


def test_rules_use_only_exported_metrics():
    import re

    text = (PROM / "rules.yml").read_text()
    used = set(re.findall(r"\bkvgate_[a-z0-9_]+", text))
    assert used and not used - exported_names(), sorted(used - exported_names())
    alerts = {r["alert"] for g in yaml.safe_load(text)["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == {
        "KvgateWorkerDown",
        "KvgateSLOAttainmentLow",
        "KvgateIndexLag",
        "KvgateKVCacheExhausted",
        "KvgateErrorRateHigh",
        "KvgateNixlWritesTimingOut",
        "KvgateRedisDown",
        "KvgateForeignRegistrations",
    }


def k8s_docs() -> list[dict]:
    return [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def test_kubernetes_manifests_validate_against_the_api_schemas():
    docs = k8s_docs()
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("Deployment", "kvgate-gateway"),
        ("Deployment", "kvgate-worker"),
        ("Deployment", "redis"),
        ("Service", "kvgate-gateway"),
    } <= kinds
    gateway = next(d for d in docs if d["metadata"]["name"] == "kvgate-gateway" and d["kind"] == "Deployment")
    assert gateway["spec"]["replicas"] >= 2, "gateway replicas share Redis"


def test_kubernetes_commands_parse_and_scrape_config_finds_the_pods():
    docs = k8s_docs()
    for d in docs:
        if d["kind"] != "Deployment" or not d["metadata"]["name"].startswith("kvgate"):
            continue
        (c,) = d["spec"]["template"]["spec"]["containers"]
        command, *args = c["args"]
        args = (gateway_parser() if command == "gateway" else worker_parser()).parse_args(args)
        env = {e["name"] for e in c["env"]}
        assert {"KVGATE_REDIS_URL", "KVGATE_INTERNAL_TOKEN"} <= env, "Redis and the fleet token come by environment"
    headless = {
        d["metadata"]["name"]: d["spec"]["ports"][0]["port"]
        for d in docs
        if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"
    }
    scrape = yaml.safe_load((PROM / "kubernetes.yml").read_text())["scrape_configs"]
    for job in scrape:
        sd = job["dns_sd_configs"][0]
        assert headless[sd["names"][0].split(".")[0]] == sd["port"]


def test_compose_stack_is_consistent_with_kvgate_and_the_repository():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "prometheus", "grafana", "gateway", "worker-0", "worker-1"} <= set(services)
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).resolve().exists(), f"{name} mounts {volume}"
        if svc.get("image") == "kvgate:latest":
            command, *args = svc["command"]
            (gateway_parser() if command == "gateway" else worker_parser()).parse_args(args)
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()
    ports = {
        n: int(s["command"][s["command"].index("--port") + 1])
        for n, s in services.items()
        if "--port" in (s.get("command") or [])
    }
    prom = yaml.safe_load((PROM / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {f"{n}:{p}" for n, p in ports.items()}
    datasource = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/kvgate.yaml").read_text())
    mounted = [v.split(":")[1] for v in services["grafana"]["volumes"]]
    assert provider["providers"][0]["options"]["path"] in mounted


def test_dockerfile_copies_what_exists():
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in shlex.split(line)[1:-1]:
                assert (ROOT / src).exists(), src
