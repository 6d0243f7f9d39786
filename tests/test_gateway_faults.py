"""The gateway when workers fail: liveness, upstream timeouts, retries, circuit breakers and
its own SIGTERM drain; real gateway and worker processes on loopback.

Faults are real: workers are SIGKILLed or SIGSTOPped, and `bench.fault_worker` (a real
worker whose executor misbehaves on marked prompts) stops or freezes its engine thread behind
a live HTTP server.
"""

import concurrent.futures as cf
import json
import signal

import httpx
import pytest

from bench import fault_worker as fw
from gateway.procs import Proc, Worker, start_gateway, stop_all, wait_for

MODEL = "smollm2-135m"


def start_fault_worker(name: str, log_dir: str, extra: tuple[str, ...] = ()) -> Proc:
    return fw.start(name, MODEL, log_dir, extra)


def slow_profile(tmp_path, base_ms: float = 20.0) -> str:
    """A sim cost model whose every step takes at least `base_ms`, so requests last a while."""
    path = tmp_path / f"slow-{base_ms:g}.json"
    path.write_text(json.dumps({"base_ms": base_ms}))
    return str(path)


def complete(url: str, prompt, max_tokens: int = 4, timeout: float = 60, **extra) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        timeout=timeout,
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra},
    )


def stream(url: str, prompt, max_tokens: int = 4, timeout: float = 60) -> tuple[int, dict, list[str]]:
    """(status, headers, SSE data payloads) of a streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        return r.status_code, dict(r.headers), [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """Fault workers f0, f1 behind three round-robin gateways: "live" with default liveness,
    "blind", which polls health once a minute and ignores stalls, so that only its upstream
    timeouts and circuit breakers can find a frozen engine, and "bounded", with default
    liveness, a 0.3 s first-byte timeout and a 4 s answer timeout."""
    tmp = tmp_path_factory.mktemp("faults")
    logs = str(tmp)
    faulty = [start_fault_worker(f"f{i}", logs, ("--sim-profile", slow_profile(tmp))) for i in range(2)]
    procs = list(faulty)
    try:
        for w in faulty:
            w.wait_ready(timeout=180)
        urls = [w.url for w in faulty]
        gateways = {  # after the workers: a gateway polling once a minute must find them up at once
            "live": start_gateway(urls, "round_robin", name="gw-live", log_dir=logs),
            "blind": start_gateway(
                urls,
                "round_robin",
                name="gw-blind",
                log_dir=logs,
                extra=[
                    "--health-interval",
                    "60",
                    "--engine-stall-s",
                    "1000",
                    "--upstream-first-byte-timeout",
                    "0.5",
                    "--upstream-idle-timeout",
                    "0.5",
                    "--breaker-failures",
                    "2",
                    "--breaker-cooldown-s",
                    "3",
                ],
            ),
            "bounded": start_gateway(
                urls,
                "round_robin",
                name="gw-bounded",
                log_dir=logs,
                extra=["--upstream-first-byte-timeout", "0.3", "--upstream-answer-timeout", "4"],
            ),
        }
        procs += list(gateways.values())
        for g in gateways.values():
            g.wait_ready("/v1/models")
            g.wait_healthy(2, what="2 healthy workers")
        yield {"faulty": faulty, **gateways, "logs": logs}
    finally:
        stop_all(procs)


def freeze(pool: cf.ThreadPoolExecutor, worker: Proc) -> cf.Future:
    """Freeze `worker`'s engine for `fw.FREEZE_S` seconds (its HTTP server keeps answering);
    returns once the freeze has begun."""
    frozen = pool.submit(complete, worker.url, [fw.FREEZE, 1, 2], 1)
    wait_for(lambda: worker.state()["engine_stall_s"] > 0.1, what="the freeze to start")
    return frozen


def finished(workers: list[Proc], reason: str) -> float:
    """Requests the workers ended with `reason` (length, abort...), all of them together."""
    return sum(w.metric("kvgate_worker_requests_finished_total", finished_reason=reason) for w in workers)


def test_a_whole_answer_may_outlast_the_first_byte_timeout(procs):
    """A non-streaming answer of 50 tokens (at least 1 s of 20 ms steps) comes whole only
    after its last token: past the 0.3 s first-byte timeout it is still awaited, within the
    4 s answer timeout, and the request goes to one worker only."""
    gw, faulty = procs["bounded"], procs["faulty"]
    retries, ended = gw.metric("kvgate_gateway_retries_total"), finished(faulty, "length")
    r = complete(gw.url, [70, 71], 50)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 50
    assert gw.metric("kvgate_gateway_retries_total") == retries
    assert finished(faulty, "length") == ended + 1


def test_a_whole_answer_past_the_answer_timeout_is_a_504_and_not_retried(procs):
    """400 tokens (at least 8 s of steps) past the 4 s answer timeout: the client gets an
    OpenAI-shaped 504 `worker_timeout`, the request is not sent to another worker (which would
    take as long), and its worker, its connection closed, aborts it."""
    gw, faulty = procs["bounded"], procs["faulty"]
    retries, timeouts = (
        gw.metric("kvgate_gateway_retries_total"),
        gw.metric("kvgate_gateway_upstream_failures_total", stage="timeout"),
    )
    aborted, ended = finished(faulty, "abort"), finished(faulty, "length")
    r = complete(gw.url, [72, 73], 400)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["code"] == "worker_timeout" and error["type"] == "server_error", error
    assert gw.metric("kvgate_gateway_retries_total") == retries
    assert gw.metric("kvgate_gateway_upstream_failures_total", stage="timeout") == timeouts + 1
    wait_for(lambda: all(w.state()["running"] == 0 for w in faulty), timeout=30, what="the request to end")
    assert finished(faulty, "length") == ended and finished(faulty, "abort") >= aborted + 1  # aborted, not run out


def test_a_whole_answer_on_a_frozen_engine_is_cut_loose_by_liveness(procs):
    """f0's engine freezes for 3 s: of two non-streaming requests sent round robin, the one on
    f0 is cut loose when liveness takes f0 out (within the 4 s answer timeout, not waiting it
    out) and retried on f1."""
    gw, (f0, _) = procs["bounded"], procs["faulty"]
    lost = gw.metric("kvgate_gateway_retries_total", stage="lost")
    with cf.ThreadPoolExecutor(3) as pool:
        frozen = freeze(pool, f0)
        answers = [pool.submit(complete, gw.url, [80 + i, 81], 2) for i in range(2)]
        assert all(a.result().status_code == 200 for a in answers), [a.result().text for a in answers]
        assert {a.result().headers["x-kvgate-worker"] for a in answers} == {"f1"}
        frozen.result()
    assert gw.metric("kvgate_gateway_retries_total", stage="lost") == lost + 1
    gw.wait_healthy(2, timeout=10, what="f0 back in service")


def test_frozen_engine_is_taken_out_and_its_waiting_requests_retried(procs):
    """f0's engine freezes for 3 s behind a live HTTP server: requests the gateway sent there
    before it noticed are retried on f1, streaming or not, instead of waiting out the freeze."""
    gw, (f0, _) = procs["live"], procs["faulty"]
    with cf.ThreadPoolExecutor(9) as pool:
        frozen = freeze(pool, f0)
        plain = [pool.submit(complete, gw.url, [10 + i, 11, 12]) for i in range(4)]
        streams = [pool.submit(stream, gw.url, [20 + i, 21, 22]) for i in range(4)]
        answers = [f.result() for f in plain]
        streamed = [f.result() for f in streams]
        assert frozen.result().status_code == 200
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    assert {r.headers["x-kvgate-worker"] for r in answers} == {"f1"}
    for status, headers, events in streamed:
        assert status == 200 and headers["x-kvgate-worker"] == "f1"
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert gw.metric("kvgate_gateway_retries_total", stage="lost") >= 1
    gw.wait_healthy(2, timeout=10, what="f0 back in service")


def test_dead_engine_is_taken_out(procs):
    """A worker whose engine thread died still answers /state, but is no candidate: every
    request through the gateway is served by the other worker."""
    doomed = start_fault_worker("doomed", procs["logs"]).wait_ready(timeout=180)
    gw = start_gateway(
        [doomed.url, procs["faulty"][1].url], "round_robin", name="gw-dead-engine", log_dir=procs["logs"]
    )
    try:
        gw.wait_ready("/v1/models")
        gw.wait_healthy(2, what="2 healthy workers")
        with cf.ThreadPoolExecutor(1) as pool:
            pool.submit(complete, doomed.url, [fw.DIE, 1, 2], 1, timeout=5)
            wait_for(lambda: doomed.state()["engine_alive"] is False, what="the engine to die")
        gw.wait_healthy(1, timeout=10, what="the dead engine to leave the candidates")
        answers = [complete(gw.url, [30 + i, 31]) for i in range(4)]
        assert all(r.status_code == 200 and r.headers["x-kvgate-worker"] == "f1" for r in answers)
    finally:
        stop_all([gw, doomed])


def busy_worker(gw: Proc, workers: list[Proc]) -> Proc:
    """The one of `workers` the gateway has a request open on."""

    def find():
        return next((w for w in workers if gw.metric("kvgate_gateway_in_flight", worker=w.name)), None)

    return wait_for(find, what="a worker holding the request")


@pytest.mark.parametrize("streaming", [True, False])
def test_worker_killed_before_the_first_token_is_retried(tmp_path, streaming):
    """The worker dies while prefilling a long prompt: the request goes to the other worker and
    the client gets a whole answer, streamed or not."""
    logs = str(tmp_path)
    profile = tmp_path / "slow-prefill.json"
    profile.write_text(json.dumps({"prefill_token_ms": 5.0}))  # 64-token chunks: 0.3 s steps
    extra = ("--sim-profile", str(profile), "--max-batched-tokens", "64")
    workers = [Worker(worker_id=f"k{i}", log_dir=logs, extra=extra) for i in range(2)]
    gw = None
    try:
        for w in workers:
            w.ready()
        gw = start_gateway([w.url for w in workers], "round_robin", name="gw-kill", log_dir=logs)
        gw.wait_ready("/v1/models")
        gw.wait_healthy(2, what="2 healthy workers")
        call = stream if streaming else complete
        with cf.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(call, gw.url, list(range(100, 500)), 3)
            victim = busy_worker(gw, workers)
            victim.kill()
            result = answer.result()
        survivor = next(w for w in workers if w is not victim)
        if streaming:
            status, headers, events = result
            assert status == 200 and headers["x-kvgate-worker"] == survivor.name
            assert events[-1] == "[DONE]" and "error" not in events[-2], events
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        else:
            assert result.status_code == 200, result.text
            assert result.headers["x-kvgate-worker"] == survivor.name
    finally:
        stop_all([p for p in (gw, *workers) if p is not None])


def test_frozen_worker_times_out_and_its_breaker_opens(procs):
    """f0's engine freezes for 3 s and the gateway does not look at liveness: streams sent to
    f0 time out after the 0.5 s first-byte timeout and go to f1; after two such failures f0's
    breaker opens and no request tries it; after the freeze and the cooldown a trial closes it.
    (A whole answer is bounded by the answer timeout instead: test_a_whole_answer_*.)"""
    gw, (f0, _) = procs["blind"], procs["faulty"]
    with cf.ThreadPoolExecutor(1) as pool:
        frozen = freeze(pool, f0)
        answers = [stream(gw.url, [40 + i, 41]) for i in range(6)]
        frozen.result()
    for status, headers, _ in answers:
        assert status == 200 and headers["x-kvgate-worker"] == "f1"
    assert gw.metric("kvgate_gateway_retries_total", stage="timeout") == 2
    assert gw.metric("kvgate_gateway_upstream_failures_total", worker="f0") == 2
    served = wait_for(
        lambda: complete(gw.url, [50, 51]).headers["x-kvgate-worker"] == "f0",
        timeout=20,
        interval=0.3,
        what="f0 to serve again after its breaker's cooldown",
    )
    assert served


def test_stream_that_falls_silent_ends_with_an_error_event(procs):
    """A committed stream whose worker's engine freezes gets an SSE error event and [DONE]
    after the 0.5 s idle timeout, not a hang."""
    gw, faulty = procs["blind"], procs["faulty"]
    body = {"model": MODEL, "prompt": [60, 61], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with cf.ThreadPoolExecutor(1) as pool, httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(ln for ln in lines if ln.startswith("data: "))
        frozen = freeze(pool, next(w for w in faulty if w.name == r.headers["x-kvgate-worker"]))
        tail = [ln[6:] for ln in lines if ln.startswith("data: ")]
        frozen.result()
    assert tail[-1] == "[DONE]" and json.loads(tail[-2])["error"]["code"] == "worker_failed"
    assert "no event for 0.5 s" in json.loads(tail[-2])["error"]["message"]


def test_a_request_goes_to_at_most_max_retries_more_workers(tmp_path):
    """Four workers die after the gateway saw them (health polled once a minute): a request
    is tried on 1 + --max-retries of them, then answered 502 `worker_failed`."""
    logs = str(tmp_path)
    workers = [Worker(worker_id=f"d{i}", log_dir=logs) for i in range(4)]
    gw = None
    try:
        for w in workers:
            w.ready()
        gw = start_gateway(
            [w.url for w in workers],
            "round_robin",
            name="gw-retries",
            log_dir=logs,
            extra=["--health-interval", "60", "--max-retries", "2", "--breaker-failures", "100"],
        )
        gw.wait_ready("/v1/models")
        gw.wait_healthy(4, what="4 healthy workers")
        for w in workers:
            w.kill()
        r = complete(gw.url, [1, 2, 3])
        assert gw.metric("kvgate_gateway_upstream_failures_total") == 3
        assert gw.metric("kvgate_gateway_retries_total") == 2
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed", r.text
        assert r.headers["retry-after"] == "1"
    finally:
        stop_all([g for g in (gw, *workers) if g is not None])


def test_sigterm_drains_the_gateway(tmp_path):
    """SIGTERM: a stream in flight finishes whole; meanwhile new requests get 503 `draining`
    with Retry-After and /health says draining; then the gateway exits."""
    logs = str(tmp_path)
    worker = Worker(worker_id="w", log_dir=logs, extra=("--sim-profile", slow_profile(tmp_path)))
    gw = start_gateway([worker.url], name="gw-drain", log_dir=logs)
    try:
        worker.ready()
        gw.wait_ready("/v1/models")
        gw.wait_healthy(1, what="1 healthy worker")
        body = {"model": MODEL, "prompt": [7, 8], "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as s:
            lines = s.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            gw.signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(gw.url + "/health").json()["status"] == "draining", what="draining")
            r = complete(gw.url, [1, 2])
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            assert int(r.headers["retry-after"]) >= 1
            events = [first[6:]] + [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1]) >= 50
        gw.popen.wait(timeout=30)
        assert not gw.alive
    finally:
        stop_all([gw, worker])
