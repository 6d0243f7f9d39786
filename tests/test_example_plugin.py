"""The example third-party policy, loaded the ways a plugin author would load it."""

from pathlib import Path

from policies.api import DECODE, MIXED, PREFILL, FleetView, Policy, RequestView, Route, WorkerView
from policies.registry import load_policy

ROOT = Path(__file__).resolve().parents[1]
FILE_SPEC = f"{ROOT / 'examples' / 'sticky_session.py'}:StickySession"


def req(session: str | None = None, n: int = 256) -> RequestView:
    return RequestView(request_id="r", num_tokens=n, block_hashes=tuple(range(n // 16)), session_id=session)


def fleet(n: int = 8, role: str = MIXED) -> FleetView:
    return FleetView(workers=tuple(WorkerView(worker_id=f"w{i}", role=role) for i in range(n)))


def test_loads_by_file_path_and_by_module():
    by_file = load_policy(FILE_SPEC)
    by_module = load_policy("examples.sticky_session:StickySession")
    assert isinstance(by_file, Policy) and by_file.name == by_module.name == "sticky_session"


def test_a_session_stays_on_one_worker_across_replicas():
    a, b = load_policy(FILE_SPEC), load_policy(FILE_SPEC)
    f = fleet()
    for s in ("alice", "bob", "carol"):
        assert len({a.route(req(s), f).worker for _ in range(5)} | {b.route(req(s), f).worker}) == 1


def test_sessions_spread_and_only_a_leaving_workers_sessions_move():
    policy, f = load_policy(FILE_SPEC), fleet()
    before = {s: policy.route(req(f"s{s}"), f).worker for s in range(200)}
    assert len(set(before.values())) == 8
    smaller = FleetView(workers=tuple(w for w in f.workers if w.worker_id != "w3"))
    after = {s: policy.route(req(f"s{s}"), smaller).worker for s in range(200)}
    assert all(after[s] == w for s, w in before.items() if w != "w3")


def test_without_a_session_it_falls_back_to_prefix_affinity():
    f = FleetView(workers=(WorkerView(worker_id="a"), WorkerView(worker_id="b", matched_blocks=16)))
    route = load_policy(FILE_SPEC, slack_abs=2).route(req(), f)
    assert route.worker == "b" and route.predicted_cached_tokens == 240  # the last of 16 blocks is recomputed


def test_prefill_workers_never_serve_and_an_empty_fleet_is_rejected():
    policy = load_policy(FILE_SPEC)
    pd = FleetView(workers=fleet(4, PREFILL).workers + (WorkerView(worker_id="d", role=DECODE),))
    assert all(policy.route(req(f"s{i}"), pd).worker == "d" for i in range(20))
    assert policy.route(req("s"), fleet(3, PREFILL)) == Route(reject="no healthy workers")
