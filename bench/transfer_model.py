"""The P/D transfer model: a transport's fixed cost per transfer plus its bytes at its bandwidth.

`fit` takes the runs bench/transfer_payload.py measured (32 MiB to 1 GiB per transport, one
process pair) and fits seconds = latency + bytes / bandwidth by least squares; the simulator
(bench/simulate.py --kv-transport) reads the fit for the transport it models, so its P/D legs
take as long as that transport took here.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_PROFILE = "bench/results/transfer_payload.json"


@dataclass(frozen=True)
class TransferLink:
    transport: str
    latency_s: float
    gbps: float  # 1e9 bytes per second

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TransferLink":
        return cls(str(d["transport"]), float(d["latency_s"]), float(d["gbps"]))


def fit(transport: str, runs: list[dict]) -> TransferLink:
    """Least squares of seconds on bytes over a transport's successful runs; a negative
    intercept (noise on few sizes) is clamped to 0 and the slope refitted through the origin."""
    pts = [(r["bytes"], r["seconds"]) for r in runs if r["transport"] == transport and r.get("ok", True)]
    if len(pts) < 2:
        raise ValueError(f"need two runs of {transport} to fit a link, have {len(pts)}")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else my / mx
    latency = my - slope * mx
    if latency < 0 or slope <= 0:
        latency, slope = 0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
    return TransferLink(transport, latency, 1 / slope / 1e9)


def load(transport: str, path: str = DEFAULT_PROFILE) -> TransferLink:
    """The link `transport` got in a transfer_payload.py result file."""
    links = json.loads(Path(path).read_text()).get("links", {})
    if transport not in links:
        raise ValueError(f"{path} has no measured link for {transport!r} (has {sorted(links)})")
    return TransferLink.from_json(links[transport])
