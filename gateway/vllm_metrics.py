"""What a vLLM (or SGLang) server says about itself over HTTP, as plain data.

`/metrics` gives load (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc` in 0..1), the cache geometry (`vllm:cache_config_info{block_size,
num_gpu_blocks}`) and `process_start_time_seconds`, whose change means the server restarted
(its cache is gone). With data parallelism each engine reports its own series; they are added
up. `/v1/models` names the served model and its `max_model_len`; `/kv_event_sources` lists each
data-parallel rank's ZMQ endpoints. SGLang's gauges are read under their own names.

The metrics page is ~60 KB and read twice a second per worker, so only the few series used are
picked out line by line rather than parsed whole.
"""

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage")
CACHE_INFO = "vllm:cache_config_info"
STARTED = "process_start_time_seconds"


class BadAnswer(ValueError):
    """A server answer that is not what a vLLM server sends."""


@dataclass(frozen=True)
class VllmLoad:
    running: int = 0
    waiting: int = 0
    usage: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    started: float | None = None

    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) blocks, the total from the cache geometry (0 when unknown)."""
        total = self.num_blocks or 0
        return total - min(total, round(total * self.usage)), total


@dataclass(frozen=True)
class EventSource:
    """One data-parallel rank's event endpoints as the server reports them."""

    rank: int
    endpoint: str
    replay: str | None
    topic: str


def parse_metrics(text: str) -> VllmLoad:
    running = waiting = 0.0
    usages: list[float] = []
    block_size = num_blocks = None
    started = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, labels, value = _sample(line)
        if name in RUNNING:
            running += value
        elif name in WAITING:
            waiting += value
        elif name in USAGE:
            usages.append(value)
        elif name == CACHE_INFO:
            block_size = _int_label(labels, "block_size", block_size)
            blocks = _int_label(labels, "num_gpu_blocks", None)
            num_blocks = (num_blocks or 0) + blocks if blocks is not None else num_blocks
        elif name == STARTED:
            started = value
    usage = sum(usages) / len(usages) if usages else 0.0
    return VllmLoad(int(running), int(waiting), min(1.0, max(0.0, usage)), block_size, num_blocks, started)


def _sample(line: str) -> tuple[str, str, float]:
    """(name, label text, value) of one exposition line; value NaN when it does not parse."""
    brace = line.find("{")
    if brace >= 0:
        end = line.rfind("}")
        name, labels, rest = line[:brace], line[brace + 1 : end], line[end + 1 :]
    else:
        name, _, rest = line.partition(" ")
        labels = ""
    try:
        value = float(rest.split()[0])
    except (ValueError, IndexError):
        value = math.nan
    return name, labels, value if math.isfinite(value) else 0.0


def _int_label(labels: str, key: str, default: int | None) -> int | None:
    needle = f'{key}="'
    at = labels.find(needle)
    if at < 0 or (at > 0 and labels[at - 1] not in ", "):
        return default
    raw = labels[at + len(needle) : labels.find('"', at + len(needle))]
    return int(raw) if raw.isdigit() and int(raw) > 0 else default


def parse_models(body: object) -> tuple[str, int | None]:
    """(served model name, max_model_len) of the base model in a `/v1/models` answer
    (LoRA adapters are listed with a `parent`)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise BadAnswer("/v1/models has no 'data' list")
    for m in data:
        if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent") is None:
            n = m.get("max_model_len")
            return m["id"], n if type(n) is int and n > 0 else None
    raise BadAnswer("/v1/models lists no base model")


def parse_sources(body: object) -> list[EventSource]:
    """Each rank's endpoints from `/kv_event_sources` (`{rank: KVEventsConfig}`), by rank."""
    if not isinstance(body, dict):
        raise BadAnswer("/kv_event_sources is not an object")
    out = []
    for rank, cfg in body.items():
        if not (isinstance(cfg, dict) and str(rank).isdigit() and isinstance(cfg.get("endpoint"), str)):
            raise BadAnswer(f"/kv_event_sources entry {str(rank)[:20]!r} has no endpoint")
        if not cfg.get("enable_kv_cache_events", True) or cfg.get("publisher", "zmq") != "zmq":
            continue
        replay, topic = cfg.get("replay_endpoint"), cfg.get("topic") or ""
        out.append(
            EventSource(
                int(rank),
                cfg["endpoint"],
                replay if isinstance(replay, str) else None,
                topic if isinstance(topic, str) else "",
            )
        )
    return sorted(out, key=lambda s: s.rank)


def subscribe_address(endpoint: str, host: str) -> tuple[str, bool]:
    """Where a subscriber reaches a publisher's `endpoint`, and whether it must bind there.

    vLLM binds wildcard (`*`, `::`) and ipc endpoints, which the subscriber connects to on the
    worker's `host`; to any other tcp endpoint vLLM connects, so the subscriber binds it."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint, False
    if "*" in endpoint or "::" in endpoint:
        return _on_host(endpoint, host), False
    return endpoint, True


def replay_address(endpoint: str, host: str) -> str:
    """The replay ROUTER is always bound by the publisher: connect to it on the worker's host."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    return _on_host(endpoint, host)


def _on_host(endpoint: str, host: str) -> str:
    port = endpoint.rsplit(":", 1)[-1]
    if "*" in endpoint or "::" in endpoint or "0.0.0.0" in endpoint:
        return f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"
    return endpoint


def worker_id(url: str) -> str:
    """A vLLM server's id in the fleet, from the URL gateways reach it at: vLLM has no id of its
    own, and a `kvgate bridge` and every gateway must name it alike."""
    parts = urlsplit(url)
    return f"vllm@{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
