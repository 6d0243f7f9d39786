"""gateway.kv_lines.Lines: a /kv/events stream's body, however it is cut into reads, applied line
by line with each line's state merged onto the last; the stream ends on the caller's word or
on a line that is not a batch. Pure: no processes."""

import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.kv_lines import LINE_BYTES, Lines


class Conn:
    closed = False

    def close(self) -> None:
        self.closed = True


def stream(n: int) -> bytes:
    lines = [
        {"worker_id": "w", "last_seq": i, "events": [], "state": {"running": i % 3} if i % 2 else {}} for i in range(n)
    ]
    lines[0]["state"] = {"worker_id": "w", "running": 0, "waiting": 0}
    return b"".join(json.dumps(body).encode() + b"\n" for body in lines)


@given(st.integers(1, 12), st.lists(st.integers(1, 400), max_size=30))
def test_any_cut_of_the_stream_applies_the_same_lines_with_whole_states(n, cuts):
    data, got = stream(n), []
    lines = Lines(lambda body: got.append(body) or True, Conn())
    at = 0
    for size in cuts:
        lines(data[at : at + size])
        at += size
    lines(data[at:])
    assert [b["last_seq"] for b in got] == list(range(n))
    for i, b in enumerate(got):
        running = max((j for j in range(1, i + 1, 2)), default=0) % 3
        assert b["state"] == {"worker_id": "w", "running": running, "waiting": 0}
    assert not lines.ended and lines.error is None


def test_the_caller_ends_the_stream_and_later_lines_are_not_applied():
    got, conn = [], Conn()
    lines = Lines(lambda body: got.append(body["last_seq"]) or body["last_seq"] < 2, conn)
    lines(stream(6))
    assert got == [0, 1, 2] and lines.ended and conn.closed and lines.error is None
    lines(stream(6))
    assert got == [0, 1, 2]


def test_a_line_that_is_not_a_batch_or_too_long_ends_the_stream_with_an_error():
    for bad in (b"not json\n", b"[1, 2]\n"):
        conn = Conn()
        lines = Lines(lambda body: True, conn)
        lines(bad)
        assert lines.ended and conn.closed and isinstance(lines.error, ValueError)
    conn = Conn()
    lines = Lines(lambda body: True, conn)
    lines(b"x" * (LINE_BYTES + 1))
    assert lines.ended and conn.closed and "over" in str(lines.error)
