"""gateway.procs' port picking: children started together never get the same port."""

import itertools
import sys

from gateway import procs


def test_free_port_never_hands_out_one_port_twice(monkeypatch):
    """A fixture picks ports for several children before any of them binds: a random pick
    that comes up with a port already handed out is drawn again."""
    monkeypatch.setenv("KVGATE_PORTS", "29100-29119")
    monkeypatch.setattr(procs, "_handed_out", set())
    draws = itertools.chain.from_iterable((p, p) for p in range(29100, 29120))  # every port drawn twice
    monkeypatch.setattr(procs.random, "randrange", lambda low, high: next(draws))
    assert [procs.free_port() for _ in range(5)] == [29100, 29101, 29102, 29103, 29104]


def test_free_port_starts_over_once_half_the_range_is_handed_out(monkeypatch):
    monkeypatch.setenv("KVGATE_PORTS", "29100-29103")
    monkeypatch.setattr(procs, "_handed_out", set())
    ports = [procs.free_port() for _ in range(6)]  # a range of 4: it never runs dry
    assert all(29100 <= p <= 29103 for p in ports)


def test_a_child_writes_its_log_into_a_log_dir_made_for_it(tmp_path):
    """A bench's --log-dir that does not exist yet is made, not a FileNotFoundError."""
    log_dir = tmp_path / "runs" / "first"
    p = procs.Proc("child", [sys.executable, "-c", "print('hello from the child')"], 0, str(log_dir))
    try:
        p.popen.wait(timeout=60)
    finally:
        p.stop()
    assert p.log_path.parent == log_dir
    assert "hello from the child" in p.log_path.read_text()
