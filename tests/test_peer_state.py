"""What a worker sends the gateway is checked where it arrives: a state (GET /state, or riding on
a /kv/events line), a KV-event batch, a snapshot. A malformed one is a failed poll, a dropped
and resynced residency, never a crash of the task that read it or a 500 to clients. Pure: the
worker's answers are scripted, no processes."""

import asyncio
import json
import math
from dataclasses import fields
from types import NoneType
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.testclient import TestClient

from gateway.admission import Admission, AdmissionConfig
from gateway.cli_args import parser
from gateway.fleet import Fleet
from gateway.index import ResidencyIndex
from gateway.metrics import FleetCollector
from gateway.server import build
from gateway.vllm_link import VllmLink
from gateway.worker import Worker
from workers.kv.cost_model import CostModel
from workers.kv.events import STORED, EventBatch, KVSnapshot
from workers.kv.worker_state import SERVER_FIELDS, WorkerState

# A body as a worker's server sends it (workers/control_routes.py `state_body`); a float field
# may come as a JSON int.
GOOD = {
    **WorkerState("w0", model="m", step_ms=20.0, cost_model=CostModel().to_json(), max_model_len=4096).to_json(),
    "step_prefill_tokens": 3,
    "kv_transfer": {"transport": "http", "gbps": None, "backlog_bytes": 0, "sent_bytes": 0, "failures": 0},
    "engine_alive": True,
    "engine_stall_s": 0.0,
    "draining": False,
    "in_flight": 0,
}
ANNOTATIONS = {f.name: f.type for f in fields(WorkerState)} | SERVER_FIELDS


def wrong(annotation: object) -> st.SearchStrategy:
    """JSON values a field annotated `annotation` must not take: another type, or a number
    that is no count, size or time (negative, not finite, past 2**63)."""
    types = set(get_args(annotation) or (annotation,))
    out = [st.lists(st.integers(), max_size=2)]
    if str not in types:
        out.append(st.text(max_size=5))
    if NoneType not in types:
        out.append(st.none())
    if bool not in types:
        out.append(st.booleans())
    if dict not in types:
        out.append(st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    if float in types:
        out += [st.sampled_from([math.nan, math.inf, -math.inf]), st.floats(max_value=-1e-9), st.integers(max_value=-1)]
    elif int in types:
        out += [st.floats(), st.integers(max_value=-1), st.integers(min_value=1 << 63)]
    else:
        out += [st.integers(), st.floats()]
    return st.one_of(out)


@st.composite
def a_wrong_field(draw) -> tuple[str, object]:
    name = draw(st.sampled_from(sorted(ANNOTATIONS)))
    return name, draw(wrong(ANNOTATIONS[name]))


def synced(url: str = "http://w0") -> tuple[Fleet, Worker]:
    """A fleet of one worker up with `GOOD`; a scripted answer never times out."""
    fleet = Fleet(ResidencyIndex(), interval=0.01, timeout=60.0)
    w = fleet.add(url)
    fleet.up(w, GOOD)
    return fleet, w


@given(a_wrong_field())
def test_a_state_with_any_field_of_the_wrong_type_is_refused_naming_it_and_changes_nothing(field):
    name, value = field
    fleet, w = synced()
    before = (w.state, w.base, w.healthy)
    with pytest.raises(ValueError, match=name):
        fleet.up(w, {**GOOD, name: value})
    assert (w.state, w.base, w.healthy) == before


def test_a_line_is_checked_against_the_last_accepted_state_not_the_last_seen():
    """A KV-event line's state is the stream's last with what changed merged in: what is the
    accepted state's own object is not checked again, but a bad value the stream carries on
    from a refused line is, at every line, until a line mends it."""
    fleet, w = synced()
    bad = {**GOOD, "cost_model": {**GOOD["cost_model"], "base_ms": math.inf}}
    with pytest.raises(ValueError, match="cost_model"):
        fleet.up(w, bad)
    with pytest.raises(ValueError, match="cost_model"):
        fleet.up(w, {**bad, "running": 1})  # the next line, the bad model carried on
    fleet.up(w, {**bad, "running": 2, "cost_model": GOOD["cost_model"]})
    assert w.state["running"] == 2 and w.state["cost_model"] is GOOD["cost_model"]


@pytest.mark.parametrize(
    "body",
    [
        [],
        "w0",
        {"model": "m"},  # no worker_id
        {"worker_id": ""},
        {"worker_id": "w0", "block_size": 0},  # prompts are cut into blocks of it
        {**GOOD, "cost_model": {"base_ms": "4"}},
        {**GOOD, "cost_model": {"base_ms": math.nan}},
        {**GOOD, "cost_model": {"decode_batch_ms": [1.0, "x"]}},
        {**GOOD, "kv_transfer": {"transport": ["http"]}},
        {**GOOD, "kv_transfer": {"gbps": "fast"}},
        {**GOOD, "kv_transfer": {"backlog_bytes": -1}},
    ],
)
def test_a_body_that_is_no_state_or_holds_a_bad_object_is_refused(body):
    with pytest.raises(ValueError):
        WorkerState.from_json(body)


class Scripted:
    """Workers' /state answers, one per poll, handed out by the test (`Fleet.get` replaced)."""

    def __init__(self, urls: list[str]):
        self.answers = {u: asyncio.Queue() for u in urls}
        self.asked = {u: asyncio.Event() for u in urls}

    async def get(self, url: str, timeout: float, params: dict | None = None) -> dict:
        base = url.removesuffix("/state")
        self.asked[base].set()
        return await self.answers[base].get()

    async def answer(self, url: str, body: object) -> None:
        """Hand `url`'s poller `body` and wait until it has dealt with it (it asks again)."""
        await asyncio.wait_for(self.asked[url].wait(), 10)
        self.asked[url].clear()
        self.answers[url].put_nowait(body)
        await asyncio.wait_for(self.asked[url].wait(), 10)


BAD_STATES = [
    {"worker_id": "w0", "model": "m", "waiting": "3"},
    {"worker_id": "w0", "model": "m", "max_num_seqs": None},
    {"worker_id": "w0", "model": "m", "max_model_len": "4096"},
    {"worker_id": "w0", "model": "m", "kv_transfer": []},
    {"worker_id": "w0", "model": "m", "engine_stall_s": "x"},
    [],
]


@pytest.mark.parametrize("bad", BAD_STATES)
def test_a_bad_state_fails_its_poll_and_the_poller_goes_on(monkeypatch, bad):
    async def run():
        fleet = Fleet(ResidencyIndex(), interval=0.01)
        w = fleet.add("http://w0")
        worker = Scripted([w.url])
        monkeypatch.setattr(fleet, "get", worker.get)
        poller = asyncio.create_task(fleet._poll(w))
        try:
            await worker.answer(w.url, GOOD)
            assert w.healthy and w.available
            await worker.answer(w.url, bad)
            assert not w.healthy and w.probe_failures == 1 and w.state == GOOD
            await worker.answer(w.url, GOOD)  # the same poller, still polling
            assert w.healthy and not poller.done()
        finally:
            poller.cancel()

    asyncio.run(run())


def test_a_worker_with_a_bad_state_is_no_candidate_and_the_models_list_answers(monkeypatch):
    """A string `max_model_len` beside another worker's int failed /v1/models for every model,
    and a null `max_num_seqs` failed admission for every request to its model: 500s."""
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    gw = build(parser().parse_args(["--health-interval", "0.05", *(a for u in urls for a in ("--worker", u))]))
    workers = [gw.fleet.workers[u] for u in urls]

    async def poll():
        script = Scripted(urls)
        monkeypatch.setattr(gw.fleet, "get", script.get)
        pollers = [asyncio.create_task(gw.fleet._poll(w)) for w in workers]
        try:
            await script.answer(urls[0], {**GOOD, "worker_id": "a", "max_model_len": 2048, "newer_field": [1]})
            await script.answer(urls[1], {**GOOD, "worker_id": "b", "max_model_len": "1024"})
            await script.answer(urls[2], {**GOOD, "worker_id": "c", "max_num_seqs": None})
        finally:
            for p in pollers:
                p.cancel()

    asyncio.run(poll())
    assert gw.fleet.candidates("m") == workers[:1]
    assert Admission(AdmissionConfig()).open_workers(gw.fleet.candidates("m")) == workers[:1]
    r = TestClient(gw.app, raise_server_exceptions=False).get("/v1/models")
    assert r.status_code == 200
    assert [(m["id"], m["max_model_len"]) for m in r.json()["data"]] == [("m", 2048)]


def test_a_task_of_a_worker_that_fails_is_started_again_and_the_worker_taken_down(monkeypatch):
    """A poller or tail that died of anything left its worker's health frozen for good."""

    async def run():
        fleet, w = synced()
        polls: list[bool] = []
        again = asyncio.Event()

        async def poller(w: Worker) -> None:
            polls.append(w.healthy)
            if len(polls) == 1:
                raise RuntimeError("a bug")
            again.set()
            await asyncio.Event().wait()

        async def tail(w: Worker) -> None:
            await asyncio.Event().wait()

        monkeypatch.setattr(fleet, "_poll", poller)
        monkeypatch.setattr(fleet.tail, "run", tail)
        await fleet.start()
        try:
            await asyncio.wait_for(again.wait(), 10)
            assert polls == [True, False] and not w.healthy and len(w.tasks) == 2
        finally:
            await fleet.stop()

    asyncio.run(run())


# KV events and snapshots


def batch(*events: dict, last_seq: int | None = None) -> dict:
    return {"worker_id": "w0", "events": list(events), "last_seq": last_seq or len(events), "gap": False}


def stored(seq: int, hashes: list) -> dict:
    return {"seq": seq, "kind": STORED, "hashes": hashes}


@pytest.mark.parametrize(
    "body",
    [
        batch(stored(1, [[1]])),
        batch(stored(1, [1.5])),
        batch(stored(1, ["1"])),
        batch(stored(1, [True])),
        batch(stored(1, 7)),
        batch({"seq": 1, "kind": "spilled", "hashes": [1]}),
        batch({"seq": 1, "kind": STORED, "hashes": [1], "medium": "tape"}),
        batch({"seq": 1, "kind": STORED, "hashes": [1], "parent": "x"}),
        batch({"seq": "1", "kind": STORED, "hashes": [1]}),
        batch({"seq": 1e400, "kind": STORED, "hashes": [1]}),
        batch({"seq": 2**63, "kind": STORED, "hashes": [1]}),
        batch(stored(1, [-1])),
        batch(stored(1, [2**64])),
        batch({"seq": 1, "kind": STORED, "hashes": [1], "parent": 2**64}),
        batch(stored(1, [1]), last_seq=-1),
        batch([1, STORED]),
        {**batch(stored(1, [1])), "events": {"1": 1}},
        {**batch(stored(1, [1])), "worker_id": 7},
        {**batch(stored(1, [1])), "gap": "no"},
        {"worker_id": "w0", "last_seq": 1},
        [],
    ],
)
def test_a_malformed_batch_is_refused(body):
    with pytest.raises(ValueError):
        EventBatch.from_json(body)


@given(st.integers(min_value=1, max_value=4), st.sampled_from([[1], 1.5, "1", None, True, {"h": 1}]))
def test_nothing_of_a_batch_with_one_malformed_event_is_applied(good, bad):
    fleet, w = synced()
    fleet.index.reset("w0", [], 0)
    events = [stored(i + 1, [100 + i]) for i in range(good)] + [stored(good + 1, [bad])]
    with pytest.raises(ValueError):
        fleet.tail.apply_line(w, "w0", w.epoch, batch(*events))
    assert fleet.index.seq("w0") == 0 and fleet.index.num_blocks("w0") == 0


@pytest.mark.parametrize(
    "body",
    [
        {"worker_id": "w0", "seq": 1e400, "hashes": []},
        {"worker_id": "w0", "seq": 1.5, "hashes": []},
        {"worker_id": "w0", "seq": 1, "hashes": ["1"]},
        {"worker_id": "w0", "seq": 1, "hashes": [], "tiers": {"host": [1.0]}},
        {"worker_id": "w0", "seq": True, "hashes": []},
        {"worker_id": "w0", "seq": "1", "hashes": []},
        {"worker_id": "w0", "seq": -1, "hashes": []},
        {"worker_id": "w0", "seq": 1, "hashes": [2**64]},
        {"worker_id": "w0", "seq": 1, "hashes": [], "tiers": {"disk": [-5]}},
        {"worker_id": 0, "seq": 1, "hashes": []},
    ],
)
def test_a_malformed_snapshot_is_refused(body):
    with pytest.raises(ValueError):
        KVSnapshot.from_json(body)


class Stream:
    """An answered /kv/events stream: its bytes handed to the sink (`Upstream.pipe`), then its end."""

    def __init__(self, data: bytes):
        self.data, self.status = data, 200

    async def pipe(self, sink, drain, idle_s: float) -> None:
        sink(self.data)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class Peer:
    """A worker's /kv/snapshot answers and /kv/events streams, scripted: `get` stands for
    `Fleet.get`, `stream` for `fleet.streams.get`. A request past its script waits for good,
    and sets `idle`: the tail has taken all it was given."""

    def __init__(self, snapshots: list, streams: list[bytes]):
        self.snapshots, self.streams = snapshots, streams
        self.asked = {"snapshot": 0, "events": 0}
        self.idle = asyncio.Event()

    async def _next(self, script: list):
        if not script:
            self.idle.set()
            await asyncio.Event().wait()
        return script.pop(0)

    async def get(self, url: str, timeout: float, params: dict | None = None) -> object:
        assert url.endswith("/kv/snapshot")
        self.asked["snapshot"] += 1
        return await self._next(self.snapshots)

    async def stream(self, url: str, path: str, headers: dict) -> Stream:
        self.asked["events"] += 1
        return Stream(await self._next(self.streams))


async def tail_until_idle(monkeypatch, fleet: Fleet, w: Worker, peer: Peer) -> asyncio.Task:
    """Run `w`'s KV tail against `peer` until it has taken all of the script, or has died."""
    monkeypatch.setattr(fleet, "get", peer.get)
    monkeypatch.setattr(fleet.streams, "get", peer.stream)
    task = asyncio.create_task(fleet.tail.run(w))
    idle = asyncio.create_task(peer.idle.wait())
    await asyncio.wait([task, idle], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    idle.cancel()
    return task


def line(body: object) -> bytes:
    return json.dumps(body).encode() + b"\n"


def test_a_malformed_line_is_counted_drops_the_residency_and_resyncs_from_a_snapshot(monkeypatch):
    """A batch whose event could not be applied was retried from the same seq for good: the
    worker's residency neither dropped nor resynced, nothing counted or said."""

    async def run():
        fleet, w = synced()
        snapshots = [{"worker_id": "w0", "seq": 0, "hashes": [5]}, {"worker_id": "w0", "seq": 3, "hashes": [6, 7]}]
        peer = Peer(snapshots, [line(batch(stored(1, [[1]])))])
        task = await tail_until_idle(monkeypatch, fleet, w, peer)
        try:
            assert not task.done() and peer.asked == {"snapshot": 2, "events": 2}
            assert w.malformed_kv == 1 and w.healthy  # its events are bad, not its state
            assert fleet.index.seq("w0") == 3 and fleet.index.num_blocks("w0") == 2  # the second snapshot's
            [family] = [f for f in FleetCollector(fleet).collect() if f.name == "kvgate_gateway_worker_malformed_kv"]
            assert [(s.labels["worker"], s.value) for s in family.samples if s.name.endswith("_total")] == [("w0", 1)]
        finally:
            task.cancel()

    asyncio.run(run())


def test_a_snapshot_with_an_overflowing_seq_is_counted_and_fetched_again(monkeypatch):
    """`1e400` parses to inf, and int(inf) raised OverflowError: the tail died, never respawned."""

    async def run():
        fleet, w = synced()
        bad = json.loads('{"worker_id": "w0", "seq": 1e400, "hashes": []}')
        peer = Peer([bad, {"worker_id": "w0", "seq": 2, "hashes": [5]}], [])
        task = await tail_until_idle(monkeypatch, fleet, w, peer)
        try:
            assert not task.done() and peer.asked == {"snapshot": 2, "events": 1}
            assert w.malformed_kv == 1 and fleet.index.seq("w0") == 2
        finally:
            task.cancel()

    asyncio.run(run())


def test_a_line_whose_state_is_bad_takes_the_worker_down_as_such_a_poll_would():
    async def run():
        fleet, w = synced()
        fleet.index.reset("w0", [], 0)
        body = batch(stored(1, [7])) | {"state": {**GOOD, "waiting": "3"}}
        with pytest.raises(ValueError, match="waiting"):
            fleet.tail.apply_line(w, "w0", w.epoch, body)
        assert not w.healthy and fleet.index.seq("w0") is None and w.state == GOOD

    asyncio.run(run())


def test_a_vllm_state_past_its_range_takes_the_server_down():
    """The vLLM link builds a state from the server's answers: one that is not a state (here a
    max_model_len past 2**63) took its poll task down with a ValueError; now the server is."""

    class Link(VllmLink):
        why: str | None = None

        async def text(self, path: str) -> str:
            return "" if path == "/health" else "process_start_time_seconds 100.0\n"

        def up(self, state: dict) -> None:
            WorkerState.from_json(state)

        def down(self, why: str) -> None:
            self.why = why

    link = Link("http://127.0.0.1:9", 16, 1.0, 1.0)
    link.model, link.started, link.max_model_len = "m", 100.0, 2**63
    asyncio.run(link.poll())
    assert link.why is not None and "max_model_len" in link.why
