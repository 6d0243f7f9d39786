"""Admission control's bounds and refusals, and a worker's queue as the gateway counts it: pure."""

from gateway.admission import DRAINING, OVERLOADED, Admission, AdmissionConfig
from gateway.fleet import Fleet
from gateway.index import ResidencyIndex


def worker(fleet: Fleet, url: str, **state):
    w = fleet.add(url)
    fleet.up(w, {"worker_id": url, "model": "m", "max_num_seqs": 4, **state})
    return w


def test_a_workers_queue_is_its_report_corrected_by_what_was_sent_and_finished_since():
    fleet = Fleet(ResidencyIndex())
    w = worker(fleet, "a", running=4, waiting=3)
    assert w.queued() == 3
    for _ in range(2):
        fleet.begin(w)  # sent since the report
    assert w.queued() == 5
    for _ in range(5):
        fleet.end(w)  # the two, and three it had before the report, finished
    assert w.queued() == 0  # a stale report does not refuse requests for a poll interval
    idle = worker(fleet, "b")
    for _ in range(6):
        fleet.begin(idle)  # a burst between polls: the batch takes four of them
    assert idle.queued() == 2
    fleet.up(idle, {"worker_id": "b", "model": "m", "max_num_seqs": 4})  # a report taken before they arrived
    assert idle.queued() == 2  # what the gateway has open on it still counts


def test_another_replicas_sends_and_ends_correct_the_report_as_this_ones_do():
    fleet = Fleet(ResidencyIndex())
    w = worker(fleet, "a", running=4, waiting=3)
    fleet.shared(w, 1)  # another replica sent one since the report
    assert w.queued() == 4
    for _ in range(4):
        fleet.shared(w, -1)  # and saw four end
    assert w.queued() == 0 and w.shared_in_flight == 0
    (view,) = fleet.views([w], {})
    assert (view.running, view.waiting) == (1, 3)  # three of the report's ended: running ones end
    fleet.up(w, {"worker_id": "a", "model": "m", "max_num_seqs": 4, "running": 2})
    assert fleet.views([w], {})[0].running == 2  # a new report starts the count again


def test_full_workers_are_no_candidates():
    fleet = Fleet(ResidencyIndex())
    a = Admission(AdmissionConfig(max_queue_per_worker=2))
    ws = [worker(fleet, "a", running=4, waiting=1), worker(fleet, "b", running=4, waiting=2)]
    assert a.open_workers(ws) == ws[:1]
    r = a.full(2)
    assert (r.status, r.code, r.retry_after_s) == (503, OVERLOADED, 1)


def test_fleet_bound_and_drain_refuse_new_requests():
    a = Admission(AdmissionConfig(max_pending=2, retry_after_s=3))
    a.enter(), a.enter()
    r = a.refuse()
    assert (r.status, r.code, r.retry_after_s) == (503, OVERLOADED, 3)
    a.leave()
    assert a.refuse() is None and not a.idle
    a.draining = True
    assert a.refuse().code == DRAINING
