"""A real Prometheus on loopback for tests and benchmarks, and the dashboard's queries as
Grafana would send them.

`ensure_prometheus` installs Debian's `prometheus` (server and promtool) when it is missing and
this runs as root; a non-root user installs it once (`sudo apt-get install prometheus`) or puts
both binaries on PATH. The server runs with a private data directory, scrapes the given targets
every second and evaluates the given rule files every second.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.procs import Proc, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "grafana/dashboards/kvgate.json"
RULES = ROOT / "deploy/prometheus/rules.yml"
RATIO_UNITS = ("percentunit",)


class PrometheusMissing(RuntimeError):
    pass


def ensure_prometheus() -> None:
    """Install Debian's prometheus package when `prometheus` or `promtool` is missing (root only)."""
    if shutil.which("prometheus") and shutil.which("promtool"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise PrometheusMissing(
            "prometheus and promtool are not on PATH: install Debian's `prometheus` "
            "package (sudo apt-get install prometheus) or put both binaries on PATH"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], check=True, env=env, stdout=subprocess.DEVNULL)


def quick_rules(src: Path, dest: Path) -> Path:
    """A copy of a rules file whose alerts fire at once (`for: 0s`), for runs of seconds."""
    dest.write_text(re.sub(r"^(\s+)for: \S+$", r"\1for: 0s", src.read_text(), flags=re.M))
    return dest


def start_prometheus(targets: dict[str, list[str]], rule_files: list[Path], log_dir: str) -> tuple[Proc, "Prom"]:
    """A Prometheus scraping `targets` ({job: [base URL]}) every second; returns the process
    and a query client once it is ready."""
    ensure_prometheus()
    home = Path(tempfile.mkdtemp(prefix="prom-", dir=log_dir))
    jobs = [
        {
            "job_name": job,
            "scrape_interval": "1s",
            "scrape_timeout": "900ms",
            "static_configs": [{"targets": [u.split("://", 1)[-1] for u in urls]}],
        }
        for job, urls in targets.items()
    ]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": jobs,
    }
    (home / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    argv = [
        "prometheus",
        f"--config.file={home / 'prometheus.yml'}",
        f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    proc = Proc("prometheus", argv, port, log_dir)
    proc.wait_ready("/-/ready", timeout=60)
    return proc, Prom(proc.url)


class Prom:
    """The query API."""

    def __init__(self, url: str):
        self.url = url

    def _get(self, path: str, **params) -> dict:
        r = httpx.get(self.url + path, params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        return self._get("/api/v1/query", query=expr, **({"time": at} if at is not None else {}))["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def scraped(self, jobs: list[str]) -> bool:
        """Whether every target of `jobs` has been scraped up at least once."""
        ups = self.query("up")
        return all(any(s["metric"]["job"] == j and s["value"][1] == "1" for s in ups) for j in jobs)

    def wait_scraped(self, jobs: list[str], timeout: float = 30.0) -> None:
        wait_for(lambda: self.scraped(jobs), timeout=timeout, interval=0.5, what="targets scraped")


@dataclass
class PanelQuery:
    """One target of a dashboard panel, with Grafana's variables put in."""

    panel: str
    unit: str
    legend: str
    expr: str


def panel_queries(
    rate_interval: str, variables: dict[str, str] | None = None, dashboard: Path = DASHBOARD
) -> list[PanelQuery]:
    """Every panel target of the dashboard as Grafana would send it: `$__rate_interval` and the
    template variables replaced (each defaults to All, `.*`)."""
    dash = json.loads(dashboard.read_text())
    names = [v["name"] for v in dash["templating"]["list"] if v["name"] != "datasource"]
    values = {n: ".*" for n in names} | (variables or {})
    out = []
    for p in dash["panels"]:
        for t in p["targets"]:
            expr = t["expr"].replace("$__rate_interval", rate_interval)
            for name, value in values.items():
                expr = expr.replace(f"${name}", value)
            out.append(PanelQuery(p["title"], p["fieldConfig"]["defaults"]["unit"], t["legendFormat"], expr))
    return out


def values_of(result: list[dict]) -> list[float]:
    """Every finite sample value of a query result (vector or matrix)."""
    out = []
    for series in result:
        for _, v in series.get("values") or [series["value"]]:
            x = float(v)
            if x == x and abs(x) != float("inf"):
                out.append(x)
    return out
