"""TTFT, TPOT and transfer predictions (policies/predict.py), from a cost model or measured steps."""

import json
import random
import time
from pathlib import Path

import pytest

from gateway.worker_view import with_fields, worker_view
from policies import predict
from policies.api import DECODE, PREFILL, FleetView, WorkerView
from policies.slo_goodput import SloGoodput
from tests.views import COST, fleet, req, worker
from workers.config import EngineConfig
from workers.engine import Engine
from workers.step_stats import StepRecord, step_means
from workers.executors.sim import SimExecutor
from workers.kv.cost_model import CostModel, StepWork
from workers.sampling_params import SamplingParams

CPU_PROFILE = Path(__file__).parent.parent / "bench" / "profiles" / "cpu-smollm2-135m.json"


def test_idle_ttft_is_the_cost_models_prefill_time():
    r, w = req(5000), worker("a", matched_blocks=10, max_batched_tokens=2048)
    assert predict.uncached_tokens(r, w) == 5000 - 160
    assert predict.ttft_ms(r, w) == pytest.approx(COST.prefill_ms(4840, 160, chunk=2048))


def test_a_fully_cached_prompt_recomputes_the_block_of_its_last_token():
    """Workers (ours and vLLM) stop a hit at num_tokens - 1: a block-aligned prompt that is all
    cached recomputes its last block, one token longer takes every block and prefills one token."""
    w = worker("a", matched_blocks=4)
    assert (predict.cached_tokens(req(64), w), predict.uncached_tokens(req(64), w)) == (48, 16)
    assert (predict.cached_tokens(req(65), w), predict.uncached_tokens(req(65), w)) == (64, 1)


def test_ttft_grows_with_queue_and_shrinks_with_cache():
    r = req(2048)
    idle, queued = worker("a"), worker("b", waiting=4, queued_prefill_tokens=8000)
    cached = worker("c", matched_blocks=100)
    assert predict.ttft_ms(r, queued) > predict.ttft_ms(r, idle) > predict.ttft_ms(r, cached)


def test_unreported_in_flight_requests_count_as_queued_work():
    r = req(2048)
    assert predict.ttft_ms(r, worker("a", in_flight=3)) > predict.ttft_ms(r, worker("b"))


def test_running_decodes_slow_prefill_and_decode():
    r = req(1024)
    idle, busy = worker("a"), worker("b", running=64, kv_tokens=64 * 1000)
    assert predict.ttft_ms(r, busy) > predict.ttft_ms(r, idle)
    assert predict.tpot_ms(r, busy) > predict.tpot_ms(r, idle)
    assert predict.tpot_ms(r, idle) == pytest.approx(COST.decode_ms(1, 1024))


def test_queued_prefill_interferes_with_decode():
    r = req(1024)
    assert predict.tpot_ms(r, worker("a", queued_prefill_tokens=4096, waiting=2)) > predict.tpot_ms(r, worker("b"))


def test_measured_step_time_scales_predictions_without_a_cost_model():
    r = req(1024)
    fast = WorkerView(worker_id="f", running=8, step_ms=COST.decode_ms(8, 0), step_decode_seqs=8)
    slow = WorkerView(worker_id="s", running=8, step_ms=2 * COST.decode_ms(8, 0), step_decode_seqs=8)
    assert predict.ttft_ms(r, slow) == pytest.approx(2 * predict.ttft_ms(r, fast))
    assert predict.ttft_ms(r, WorkerView(worker_id="n")) == pytest.approx(COST.prefill_ms(1024))
    unknown = WorkerView(worker_id="u", running=8, step_ms=2 * COST.decode_ms(8, 0))
    assert predict.ttft_ms(r, unknown) == pytest.approx(predict.ttft_ms(r, fast)), (
        "a step time without the work it measured is no speed"
    )


def prefill_worker(wid: str, speed: float, chunk: int = 2048) -> WorkerView:
    """An idle prefill worker whose recent steps were `chunk`-token prefills of fresh prompts,
    each taking `speed` times the default model's time."""
    ctx = chunk * chunk / 2
    return WorkerView(
        worker_id=wid,
        role=PREFILL,
        max_batched_tokens=chunk,
        step_ms=speed * COST.step_ms(prefill_tokens=chunk, prefill_ctx_products=ctx),
        step_prefill_tokens=chunk,
        step_prefill_ctx_products=ctx,
    )


def test_a_prefill_workers_speed_comes_from_the_chunks_it_measured_not_its_empty_queue():
    """Issue 5: the step time of big chunks was compared with an empty queue's decode-only step,
    which made an idle prefill worker look ~40x slower than it is."""
    r = req(4096)
    for speed in (0.5, 1.0, 3.0):
        assert predict.ttft_ms(r, prefill_worker("p", speed)) == pytest.approx(
            speed * COST.prefill_ms(4096, chunk=2048), rel=0.05
        )


def test_slo_goodput_pairs_a_prefill_worker_measured_on_big_chunks():
    p = prefill_worker("p", speed=3.0)
    d = WorkerView(
        worker_id="d",
        role=DECODE,
        running=8,
        kv_tokens=8000,
        step_ms=3.0 * COST.decode_ms(8, 8000),
        step_decode_seqs=8,
        step_decode_kv_tokens=8000,
    )
    route = SloGoodput().route(req(4096), fleet(p, d))
    assert (route.prefill, route.worker) == ("p", "d"), route.reject
    assert route.predicted_ttft_ms < 1.2 * 3.0 * COST.prefill_ms(4096, chunk=2048)


def test_a_workers_state_carries_the_work_its_step_time_measured(monkeypatch):
    """Engine -> /state -> the gateway's view -> prediction, for a prefill worker 3x slower than
    the default model whose queue is empty by the time it is polled."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    ex = SimExecutor(COST, vocab_size=1000, wait=lambda s: clock.__setitem__(0, clock[0] + 3 * s))
    eng = Engine(ex, None, EngineConfig("m", num_blocks=1024, role=PREFILL))
    rnd = random.Random(0)
    for i, n in enumerate((3000, 4096, 2500, 5000)):
        eng.submit(
            f"r{i}",
            [rnd.randrange(3, 1000) for _ in range(n)],
            SamplingParams(max_tokens=1),
            sink=lambda out: None,
            detokenize=False,
        )
    while eng.has_work():
        eng.step()
    view = worker_view(eng.state())
    assert view.role == PREFILL and view.queued_prefill_tokens == 0 and view.running == 0
    assert predict.ttft_ms(req(4096), view) == pytest.approx(3 * COST.prefill_ms(4096, chunk=2048))


def test_transfer_moves_the_blocks_the_decode_worker_lacks():
    r = req(1024)  # 64 full blocks
    p = worker("p", role=PREFILL, kv_bytes_per_token=1000, transfer_gbps=10.0)
    d = worker("d", role=DECODE, matched_blocks=14, kv_bytes_per_token=1000, transfer_gbps=2.0)
    assert predict.transfer_ms(r, p, d) == pytest.approx(50 * 16 * 1000 / 2e6)
    assert predict.transfer_ms(r, worker("q", role=PREFILL), worker("u", role=DECODE)) == 0.0
    assert predict.pd_ttft_ms(r, p, d) == pytest.approx(
        predict.ttft_ms(r, p) + predict.transfer_ms(r, p, d) + predict.import_ttft_ms(r, d)
    )


@pytest.mark.parametrize("prefill_share", (0.1, 0.3, 0.6))
def test_prefill_and_decode_speeds_are_measured_apart(prefill_share):
    """A SmolLM2 CPU worker (its calibrated profile as the truth) prefills ~29x slower than the
    default model and decodes ~14x slower. Scaled by one factor, predicted TPOT came out up to
    30% high (so slo_goodput rejected requests the worker would have served); scaled by a
    prefill and a decode factor from the steps it reports, both are within 15%."""
    true = CostModel.from_json(json.loads(CPU_PROFILE.read_text()))
    rng, recent = random.Random(0), []
    for _ in range(32):
        seqs = rng.randint(2, 6)
        kv = seqs * rng.randint(200, 600)
        p, ctx = (256, 256 * (rng.randint(0, 512) + 128)) if rng.random() < prefill_share else (0, 0.0)
        work = StepWork(p, ctx, seqs, kv)
        recent.append(StepRecord(true.work_ms(work), work, true.work_ms(work)))
    load = dict(running=4, waiting=1, in_flight=5, queued_prefill_tokens=300, kv_tokens=2000, max_batched_tokens=256)
    measured = WorkerView(worker_id="m", **load, **step_means(recent))
    for n in (64, 1024):
        r = req(n, max_tokens=48)
        truth = predict.ttft_tpot_ms(r, worker("t", cost=true, **load))
        assert predict.ttft_tpot_ms(r, measured) == pytest.approx(truth, rel=0.15)


def test_a_decode_factor_needs_decode_only_steps():
    """A prefill worker reports no decode-only steps: one factor, its overall one, scales all."""
    p = prefill_worker("p", speed=3.0)
    assert p.decode_step_ms is None and predict._model(p)[1:] == pytest.approx((3.0, 3.0))


def test_a_request_behind_a_full_batch_waits_for_a_place_in_it():
    """Four running on a worker that runs four at a time: a new request waits about half a
    request's life for the first place, and a further life / 4 per request queued before it;
    with room in the batch it waits for none. SLO-aware routing rejects rather than admit it
    late (at 5x overload slo_goodput rejected nothing while TTFT ran 12x its SLO)."""
    r = req(64, max_tokens=20, slo_ttft_ms=1000, slo_tpot_ms=200)
    life = 20 * COST.decode_ms(4, 0)
    room = worker("room", running=3, max_num_seqs=4)
    full = worker("full", running=4, max_num_seqs=4)
    queued = worker("queued", running=4, waiting=4, max_num_seqs=4)
    assert predict.ttft_ms(r, full) - predict.ttft_ms(r, room) == pytest.approx(0.5 * life, rel=0.05)
    assert predict.ttft_ms(r, queued) - predict.ttft_ms(r, full) == pytest.approx(life, rel=0.05)
    behind = worker("behind", running=4, in_flight=4 + 40, max_num_seqs=4)  # sent, not yet reported
    assert SloGoodput().route(r, fleet(behind)).reject
    assert SloGoodput().route(r, fleet(behind, room)).worker == "room"


def test_a_request_waits_its_turn_in_a_full_pool_counting_every_request_in_flight():
    """The pool as the batch: nothing while it holds every request in flight with its whole
    output; past that (a pool its 20 running requests fill, the 21st waits for the first to
    end), requests start one per life / fits, so the wait grows with the requests
    the gateways sent that a poll does not show yet, and is far longer where shared prefixes
    pin the pool. Free blocks at the last poll do not make room for those sent since."""
    r = req(256, max_tokens=128)
    pool = dict(total_blocks=1024, running=20, kv_tokens=20 * 2300)
    roomy = worker("roomy", free_blocks=800, **pool)
    full = worker("full", free_blocks=0, **pool)
    sent = worker("sent", free_blocks=200, in_flight=60, **pool)
    more = worker("more", free_blocks=200, in_flight=90, **pool)
    pinned = worker("pinned", free_blocks=0, shared_blocks=950, **pool)
    wait = {w.worker_id: predict.pool_queue_wait_ms(r, w) for w in (roomy, full, sent, more, pinned)}
    life = 128 * COST.decode_ms(20, 20 * 2300)
    assert wait["roomy"] == 0
    assert 0 < wait["full"] < 0.1 * predict.POOL_QUEUE_SAFETY * life  # the first of 20 to end
    assert wait["full"] < wait["sent"] < wait["more"] < wait["pinned"]
    assert wait["pinned"] > 4 * predict.POOL_QUEUE_SAFETY * life


def test_the_pool_wait_is_scaled_by_the_share_of_recent_requests_refused():
    """At capacity (nothing refused) the wait is as predicted; from half the traffic refused on
    (5x capacity refuses ~0.6) it is `POOL_QUEUE_SAFETY` times that, and in between it grows
    with the share. slo_goodput counts its own refusals over a window of seconds."""
    r = req(256, max_tokens=128)
    full = worker("full", free_blocks=0, total_blocks=1024, running=20, kv_tokens=20 * 2300, in_flight=36)
    base = predict.pool_queue_wait_ms(r, full, 1.0)
    assert predict.ttft_ms(r, full) + base < 2000 < predict.ttft_ms(r, full) + predict.POOL_QUEUE_SAFETY * base
    assert predict.pool_queue_wait_ms(r, full) == pytest.approx(predict.POOL_QUEUE_SAFETY * base)
    assert predict.pool_queue_safety(0.0) == 1.0
    assert 1.0 < predict.pool_queue_safety(0.2) < predict.pool_queue_safety(0.4) < predict.POOL_QUEUE_SAFETY
    assert predict.pool_queue_safety(0.5) == predict.pool_queue_safety(0.9) == predict.POOL_QUEUE_SAFETY
    policy = SloGoodput(ttft_ms=2000, tpot_ms=100, refusal_window_s=5.0)
    assert policy.route(r, FleetView((full,), now=0.0)).worker == "full"  # nothing refused yet: a wait under the SLO
    assert policy.ttft_tpot_ms(r, full)[0] == pytest.approx(predict.ttft_ms(r, full) + base)
    for t in range(4):  # a crowd the fleet refuses: the wait doubles, and it refuses
        policy.route(req(256, max_tokens=128), FleetView((with_fields(full, in_flight=400),), now=1.0 + t))
    assert policy.route(r, FleetView((full,), now=5.0)).reject
    assert policy.route(r, FleetView((full,), now=12.0)).worker == "full"  # out of the window


def test_a_prefill_worker_exporting_in_batches_hides_part_of_the_transfer():
    """6000 tokens in 2048-token steps (3 batches of 16+ blocks): the transfer overlaps the
    prefill, so it adds less than all of it and at least its last batch's share; a worker that
    ships one payload after the prefill (export batch 0, as older workers report) adds all."""
    r = req(6000)
    d = worker("d", role=DECODE, kv_bytes_per_token=131072, transfer_gbps=1.0)
    whole = worker("p", role=PREFILL, kv_bytes_per_token=131072, transfer_gbps=1.0)
    batched = worker("p", role=PREFILL, kv_bytes_per_token=131072, transfer_gbps=1.0, export_batch_blocks=16)
    wire = predict.transfer_ms(r, whole, d)
    assert predict.exposed_transfer_ms(r, whole, d) == wire
    assert wire / 3 <= predict.exposed_transfer_ms(r, batched, d) < wire
    assert predict.pd_ttft_ms(r, batched, d) < predict.pd_ttft_ms(r, whole, d)
    assert predict.pd_ttft_ms(r, batched, d) >= predict.ttft_ms(r, batched) + predict.import_ttft_ms(r, d)


def test_what_is_queued_on_a_prefill_workers_link_delays_the_transfer():
    """A prefill worker's link first carries its exports not sent yet and the legs queued
    ahead: on a slow link that backlog, less the time until this prefill starts, is waited
    out; on a fast one it has drained before this prefill ends and adds nothing."""
    r = req(6000)
    d = worker("d", role=DECODE, kv_bytes_per_token=131072, transfer_gbps=1.0)

    def prefill(gbps: float, **kw) -> WorkerView:
        return worker("p", role=PREFILL, kv_bytes_per_token=131072, transfer_gbps=gbps, export_batch_blocks=16, **kw)

    queued = {"waiting": 4, "queued_prefill_tokens": 20000}
    idle, busy = prefill(1.0), prefill(1.0, **queued)
    ahead_ms = 20000 * 131072 / 1e6
    starts_ms = predict.ttft_ms(r, busy) - predict.own_prefill_ms(r, busy)
    wire = predict.transfer_ms(r, busy, d)
    assert predict.exposed_transfer_ms(r, busy, d) == pytest.approx(
        ahead_ms - starts_ms + wire - predict.own_prefill_ms(r, busy)
    )
    assert predict.exposed_transfer_ms(r, busy, d) > predict.exposed_transfer_ms(r, idle, d)
    sending = prefill(1.0, export_backlog_bytes=2 * 10**9)
    assert predict.exposed_transfer_ms(r, sending, d) == pytest.approx(2000 + wire - predict.own_prefill_ms(r, idle))
    fast_d = worker("d", role=DECODE, kv_bytes_per_token=131072, transfer_gbps=100.0)
    assert predict.exposed_transfer_ms(r, prefill(100.0, **queued), fast_d) == predict.exposed_transfer_ms(
        r, prefill(100.0), fast_d
    )
