"""The Date header without a timer (workers/drain.py `LazyDateState`): the header uvicorn's
once-a-second tick kept, made when a response reads the default headers instead."""

from email.utils import formatdate, parsedate_to_datetime

import uvicorn

from workers import drain
from workers.drain import DrainingServer, LazyDateState


class Idle:
    draining, in_flight, idle = False, 0, True


def loaded(**kw) -> uvicorn.Config:
    config = uvicorn.Config(
        lambda scope, receive, send: None, headers=[("x-served-by", "kvgate")], server_header=False, **kw
    )
    config.load()
    return config


def test_the_date_is_the_second_it_is_read_in(monkeypatch):
    state = LazyDateState(loaded())
    clock = [1_800_000_000.2]
    monkeypatch.setattr(drain.time, "time", lambda: clock[0])
    first = state.default_headers
    assert first == [(b"date", formatdate(1_800_000_000, usegmt=True).encode()), (b"x-served-by", b"kvgate")]
    clock[0] += 0.7
    assert state.default_headers is first  # the same second: made once
    clock[0] += 0.2
    later = dict(state.default_headers)[b"date"].decode()
    assert parsedate_to_datetime(later).timestamp() == 1_800_000_001


def test_uvicorn_assigning_default_headers_changes_nothing(monkeypatch):
    state = LazyDateState(loaded())
    state.default_headers = [(b"date", b"Thu, 01 Jan 1970 00:00:00 GMT")]  # what uvicorn's tick does
    assert dict(state.default_headers)[b"date"] != b"Thu, 01 Jan 1970 00:00:00 GMT"
    assert (b"x-served-by", b"kvgate") in state.default_headers


def test_no_date_when_the_config_says_so():
    assert LazyDateState(loaded(date_header=False)).default_headers == [(b"x-served-by", b"kvgate")]


def test_the_draining_server_uses_it():
    server = DrainingServer(loaded(), Idle())
    assert isinstance(server.server_state, LazyDateState)
    assert server.server_state.connections == set() and server.server_state.total_requests == 0
