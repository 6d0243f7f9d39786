"""What every kvgate process exports besides its own metrics: `process_*` (CPU, memory, open
files, start time), `python_*` (version, GC) and `kvgate_build_info`, so one alert or panel
covers gateways and workers alike."""

import platform
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily


def version() -> str:
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "unknown"


class _BuildInfo:
    def __init__(self, component: str):
        self.labels = [version(), component, platform.python_version()]

    def collect(self):
        g = GaugeMetricFamily(
            "kvgate_build_info",
            "Always 1: the kvgate version and component of this process",
            labels=["version", "component", "python"],
        )
        g.add_metric(self.labels, 1.0)
        yield g


def register_process_metrics(registry: CollectorRegistry, component: str) -> None:
    """Add the process, Python and build-info collectors to `registry`. Also stops the client
    library's `_created` series (one more per counter and histogram, which no kvgate query reads)."""
    disable_created_metrics()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(_BuildInfo(component))
