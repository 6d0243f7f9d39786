"""Admission control's bounds and refusals: pure."""
from gateway.admission import DRAINING, OVERLOADED, Admission, AdmissionConfig, queued
from policies.api import WorkerView


def view(**kw) -> WorkerView:
    return WorkerView(worker_id="w", **kw)


def test_queued_counts_what_the_running_batch_has_no_room_for():
    assert queued(view(max_num_seqs=4, running=2, in_flight=5)) == 1  # 3 unseen, room for 2
    assert queued(view(max_num_seqs=4, running=2, in_flight=3)) == 0
    assert queued(view(max_num_seqs=4, running=4, waiting=3, in_flight=9)) == 5  # it queues: all unseen wait
    assert queued(view(max_num_seqs=4, running=4, waiting=3, in_flight=2)) == 3  # another gateway's load


def test_full_workers_are_no_candidates():
    a = Admission(AdmissionConfig(max_queue_per_worker=2))
    views = (view(max_num_seqs=1, running=1, waiting=1), view(max_num_seqs=1, running=1, waiting=2))
    assert a.open_workers(views) == views[:1]
    r = a.full(2)
    assert (r.status, r.code, r.retry_after_s) == (503, OVERLOADED, 1)


def test_fleet_bound_and_drain_refuse_new_requests():
    a = Admission(AdmissionConfig(max_pending=2, retry_after_s=3))
    a.enter(), a.enter()
    r = a.refuse()
    assert (r.status, r.code, r.retry_after_s) == (503, OVERLOADED, 3)
    a.leave()
    assert a.refuse() is None
    a.draining = True
    assert a.refuse().code == DRAINING
