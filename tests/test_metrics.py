"""Metrics an operator can trust: the exposition passes `promtool check metrics`, counters start
at 0, TTFT is the first token's time from arrival (streaming or not), SLO outcomes are judged
per request, and a stream's usage is read without the client seeing what it did not ask for."""

import json
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.metrics import STAGES, GatewayMetrics, RedisCollector
from gateway.redis_state import RedisState
from gateway.tap import StreamTap, ask_usage, whole_answer
from gateway.record import FAILED, MET, REJECTED, TPOT_MISS, TTFT_MISS, RequestRecord, slo_outcome
from gateway.procs import Worker, start_gateway, stop_all, wait_for
from tests.test_deploy import need_prometheus

MODEL = "smollm2-135m"


def samples(text: str, name: str, **labels) -> list[float]:
    return [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def record(status=200, ttft=None, last=None, out=None, e2e=1.0, **kw) -> RequestRecord:
    rec = RequestRecord("r", "completion", 100.0, status=status, output_tokens=out, **kw)
    rec.first_token_at = None if ttft is None else 100.0 + ttft
    rec.last_token_at = None if last is None else 100.0 + last
    rec.finished_at = 100.0 + e2e
    return rec


def test_slo_outcomes_judge_each_request():
    slo = {"slo_ttft_ms": 200.0, "slo_tpot_ms": 50.0}
    assert slo_outcome(record(ttft=0.1, last=0.4, out=11, **slo)) == MET  # tpot 30 ms
    assert slo_outcome(record(ttft=0.3, last=0.4, out=11, **slo)) == TTFT_MISS
    assert slo_outcome(record(ttft=0.1, last=0.9, out=11, **slo)) == TPOT_MISS  # tpot 80 ms
    assert slo_outcome(record(ttft=0.1, last=0.1, out=1, **slo)) == MET  # one token: no TPOT
    assert slo_outcome(record(e2e=0.5, **slo)) == TTFT_MISS, "a whole answer without TTFT is judged by e2e"
    assert slo_outcome(record(ttft=5.0, last=9.0, out=3)) == MET, "no SLOs: answered is met"
    assert slo_outcome(record(status=503, code="overloaded")) == REJECTED
    assert slo_outcome(record(status=429, code="policy_rejected")) == REJECTED
    assert slo_outcome(record(status=429, code="rate_limit_exceeded")) is None, "a client over its quota"
    assert slo_outcome(record(status=502)) == slo_outcome(record(status=200, finish_reason="error")) == FAILED
    assert slo_outcome(record(status=400)) is slo_outcome(record(status=499)) is None


def test_stream_usage_is_read_and_dropped_unless_the_client_asked():
    body = {"prompt": "x", "stream": True}
    assert ask_usage(body) and body["stream_options"] == {"include_usage": True}
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    assert not ask_usage(asked) and not ask_usage({"stream": False})
    events = (
        b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n'
        b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
        b"data: [DONE]\n\n"
    )
    for hide in (True, False):
        tap = StreamTap("completion", time.monotonic(), hide_usage=hide)
        out = tap.feed(events)
        assert (tap.cached, tap.output_tokens, tap.finish_reason) == (32, 2, "length")
        assert tap.ttft is not None and tap.first_at <= tap.last_at
        assert (b'"usage"' in out) is not hide and out.endswith(b"data: [DONE]\n\n") and out.count(b"\n\n") == 4 - hide


def test_a_whole_answer_takes_its_first_token_time_from_the_worker():
    rec = RequestRecord("r", "completion", time.monotonic() - 1.0)
    sent = rec.arrived + 0.2
    whole_answer(
        rec,
        b'{"choices":[{"text":"hi","finish_reason":"stop"}],"usage":{"completion_tokens":7,'
        b'"prompt_tokens_details":{"cached_tokens":16}}}',
        {"x-kvgate-ttft-ms": "50"},
        sent,
    )
    assert rec.ttft_s == pytest.approx(0.25) and (rec.output_tokens, rec.cached_tokens, rec.finish_reason) == (
        7,
        16,
        "stop",
    )
    bad = RequestRecord("r", "completion", time.monotonic())
    whole_answer(bad, b"{}", {"x-kvgate-ttft-ms": "nan"}, bad.arrived)
    assert bad.first_token_at is None


def test_labelled_counters_start_at_zero_for_known_workers_and_models():
    fleet = Fleet(ResidencyIndex())
    w = fleet.add("http://127.0.0.1:9")
    w.worker_id, w.state = "w7", {"model": "m", "worker_id": "w7"}
    text = GatewayMetrics(fleet, "pol").render()[0].decode()
    for stage in STAGES:
        assert samples(text, "kvgate_gateway_upstream_failures_total", worker="w7", model="m", stage=stage) == [0.0]
    for outcome in ("met", "ttft_miss", "tpot_miss", "rejected", "failed"):
        assert samples(text, "kvgate_gateway_slo_requests_total", model="m", outcome=outcome) == [0.0]
    assert samples(text, "kvgate_gateway_requests_total", worker="w7", model="m", policy="pol", status="502") == [0.0]
    assert samples(text, "kvgate_gateway_prefill_legs_total", worker="w7", outcome="failed") == [0.0]


def test_redis_metrics_say_whether_the_gateway_routes_on_redis_and_what_it_dropped():
    fleet = Fleet(ResidencyIndex())
    metrics = GatewayMetrics(fleet, "pol")
    state = RedisState("redis://127.0.0.1:1/0", fleet, "secret", replica_id="a")
    metrics.registry.register(RedisCollector(state))
    text = metrics.render()[0].decode()
    assert samples(text, "kvgate_gateway_redis_up") == [0.0]
    assert samples(text, "kvgate_gateway_redis_malformed_total", what="share_line") == [0.0]
    assert samples(text, "kvgate_gateway_redis_malformed_total", what="event_entry") == [0.0]
    state.up = True
    state.share.message(b"b 1 w0 1\nb x w0 1\n{broken")
    state._apply({b"w": b"w0", b"e": b"1 bogus device - 5"})
    state.share.tables["b"] = (1, {"w0": 1})
    state.ignored = 2
    text = metrics.render()[0].decode()
    assert samples(text, "kvgate_gateway_redis_up") == [1.0]
    assert samples(text, "kvgate_gateway_redis_malformed_total", what="share_line") == [2.0]
    assert samples(text, "kvgate_gateway_redis_malformed_total", what="event_entry") == [1.0]
    assert samples(text, "kvgate_gateway_redis_malformed_total", what="inflight_table") == [0.0]
    assert samples(text, "kvgate_gateway_redis_malformed_total", what="resident_set") == [0.0]
    assert samples(text, "kvgate_gateway_redis_rejected_registrations") == [2.0]
    assert samples(text, "kvgate_gateway_redis_replicas") == [1.0]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("metrics"))
    worker = Worker(worker_id="mx", log_dir=logs)
    gw = start_gateway(
        [worker.url],
        "prefix_affinity",
        log_dir=logs,
        extra=["--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--log-format", "json", "--fleet-summary-s", "1"],
    )
    try:
        worker.ready()
        gw.wait_ready()
        yield worker, gw
    finally:
        stop_all([gw, worker])


def promtool_check(text: str) -> subprocess.CompletedProcess:
    need_prometheus()
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)


@pytest.mark.slow
def test_exposition_passes_promtool_and_carries_model_worker_process_and_build_info(fleet):
    worker, gw = fleet
    for stream in (False, True):
        r = httpx.post(
            gw.url + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": "promtool " * 20, "max_tokens": 6, "stream": stream},
        )
        assert r.status_code == 200
    for url, component in ((gw.url, "gateway"), (worker.url, "worker")):
        text = httpx.get(url + "/metrics").text
        checked = promtool_check(text)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert samples(text, "kvgate_build_info", component=component) == [1.0]
        assert samples(text, "process_resident_memory_bytes")[0] > 0
    text = httpx.get(worker.url + "/metrics").text
    usage = samples(text, "kvgate_worker_kv_cache_usage_perc", model=MODEL, worker="mx")
    assert len(usage) == 1 and 0.0 <= usage[0] <= 1.0
    for name in (
        "kvgate_worker_time_to_first_token_seconds_count",
        "kvgate_worker_inter_token_latency_seconds_count",
        "kvgate_worker_request_time_per_output_token_seconds_count",
        "kvgate_worker_request_queue_time_seconds_count",
        "kvgate_worker_request_prefill_time_seconds_count",
        "kvgate_worker_request_decode_time_seconds_count",
    ):
        assert samples(text, name, model=MODEL, worker="mx")[0] >= 2, name
    assert samples(text, "kvgate_worker_requests_finished_total", finished_reason="length")[0] >= 2
    assert samples(text, "kvgate_worker_requests_finished_total", finished_reason="error") == [0.0]


@pytest.mark.slow
def test_gateway_ttft_is_the_first_token_streaming_or_not(fleet):
    worker, gw = fleet

    def sums() -> tuple[float, float, float]:
        text = httpx.get(gw.url + "/metrics").text
        return tuple(
            sum(samples(text, f"kvgate_gateway_{n}_sum", model=MODEL, worker="mx"))
            for n in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds")
        )

    before = sums()
    r = httpx.post(
        gw.url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "ttft " * 30, "max_tokens": 48, "ignore_eos": True},
    )
    assert r.status_code == 200 and "x-kvgate-ttft-ms" not in r.headers
    ttft, e2e, tpot = (a - b for a, b in zip(sums(), before))
    assert 0 < ttft < e2e / 4, "a non-streaming request's TTFT is its first token, not the whole request"
    assert tpot > 0 and ttft + 47 * tpot == pytest.approx(e2e, rel=0.5)


@pytest.mark.slow
def test_idle_workers_add_no_step_time(fleet):
    """The step-time histogram only grows with steps: an idle worker's rate() is empty, not a stale value."""
    worker, _ = fleet

    def count() -> float:
        return samples(httpx.get(worker.url + "/metrics").text, "kvgate_worker_step_duration_seconds_count")[0]

    wait_for(lambda: worker.state()["running"] == worker.state()["waiting"] == 0, what="idle")
    first = count()
    time.sleep(1.0)
    assert first > 0 and count() == first


@pytest.mark.slow
def test_access_log_and_fleet_summary_as_json(fleet):
    worker, gw = fleet
    r = httpx.post(
        gw.url + "/v1/completions",
        timeout=60,
        headers={"x-request-id": "client-42"},
        json={"model": MODEL, "prompt": "logged " * 10, "max_tokens": 3},
    )
    rid = r.headers["x-kvgate-request-id"]

    def lines() -> list[dict]:
        return [json.loads(x) for x in gw.log_path.read_text().splitlines() if x.startswith("{")]

    access = wait_for(lambda: [x for x in lines() if x.get("request_id") == rid], what="the access line")[0]
    assert access["logger"] == "kvgate.access" and access["client_request_id"] == "client-42"
    assert (access["status"], access["worker"], access["output_tokens"], access["slo"]) == (200, "mx", 3, "met")
    assert access["ttft_ms"] > 0 and access["prompt_tokens"] > 0 and "cached_tokens" in access
    summary = wait_for(
        lambda: [x for x in lines() if x["logger"] == "kvgate.fleet" and x.get("worker") == "mx"],
        what="a fleet summary",
    )
    assert summary[-1]["healthy"] is True and {"in_flight", "requests", "failed"} <= set(summary[-1])
