"""What a worker sends the gateway is checked where it arrives: a state (GET /state, or riding on
a /kv/events line), a KV-event batch, a snapshot. A malformed one is a failed poll, a dropped
and resynced residency, never a crash of the task that read it or a 500 to clients. Pure: the
worker's answers are scripted, no processes."""

import asyncio
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
from gateway.server import build
from gateway.worker import Worker
from workers.kv.cost_model import CostModel
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
