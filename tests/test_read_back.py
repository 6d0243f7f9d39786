"""Read or recompute (workers/kv/read_back.py): a worker copies back only the part of a host or
disk hit that comes back faster than it would be recomputed; the blocks it leaves stay in their
tier untouched; a worker's engine and the simulator's take the same choice."""

import pytest

from bench.report import summarize
from gateway.worker_view import with_fields, worker_view
from policies import predict
from policies.api import TierCredits, WorkerView
from tests.test_simulate_tiers import run
from tests.views import req, worker
from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.sim import SimExecutor
from workers.kv.block_pool import BlockPool
from workers.kv.cost_model import CostModel
from workers.kv.disk_pool import DiskPool, DiskRead
from workers.kv.events import DISK, HOST, EventLog
from workers.kv.host_pool import HostPool
from workers.kv.read_back import ReadBack, copy_ms
from workers.kv.worker_state import WorkerState
from workers.request import Request
from workers.sampling_params import SamplingParams

COST = CostModel()  # 16 tokens prefill in ~1.3 ms
LLAMA8B = 131072  # KV bytes per token: a 16-token block is 2 MiB, 4.2 ms at 0.5 GB/s


def choice(host_gbps: float = 50.0, disk_gbps: float = 0.5, kv_bytes: int = LLAMA8B) -> ReadBack:
    return ReadBack(COST, 16, kv_bytes, 2048, host_gbps, disk_gbps)


def test_copy_time_is_the_blocks_bytes_at_each_tiers_rate():
    assert copy_ms(2, 1, 1e6, 50.0, 0.5) == 2 * 1e6 / 50e6 + 1e6 / 0.5e6


def test_a_fast_tier_is_loaded_and_a_slow_one_recomputed():
    rb = choice()
    assert rb.blocks([(HOST, 8)], 0, 1024) == 8
    assert rb.blocks([(DISK, 8)], 0, 1024) == 0, "4.2 ms a block to read, ~1.3 ms to recompute"
    assert rb.blocks([(HOST, 4), (DISK, 8)], 2, 1024) == 4, "the host run, not the disk run after it"
    assert rb.blocks([(HOST, 4), (DISK, 1), (HOST, 40)], 0, 1024) == 45, "one slow block is worth it for 40 fast ones"
    assert choice(disk_gbps=20.0).blocks([(HOST, 4), (DISK, 8)], 0, 1024) == 12
    assert choice(host_gbps=0.1).blocks([(HOST, 8)], 0, 1024) == 0, "a slow host link: recompute"


def test_blocks_without_bytes_are_always_loaded():
    assert choice(kv_bytes=0).blocks([(DISK, 8)], 0, 1024) == 8


def test_the_pool_loads_the_chosen_part_and_leaves_the_rest_in_its_tier_untouched():
    log = EventLog("w")
    host, disk = HostPool(4, log), DiskPool(4, log)
    pool = BlockPool(8, 2, log, host, disk)
    host.store([(11, (1, 1))])
    disk.store([(12, (2, 2)), (13, (3, 3))])
    seen = []

    def keep_host(runs: list[tuple[str, int]]) -> int:
        seen.append(runs)
        return 1

    load = pool.load_prefix([11, 12, 13], [1, 1, 2, 2, 3, 3, 4], 0, None, keep_host)
    assert seen == [[(HOST, 1), (DISK, 2)]]
    assert load is not None and load.hashes == [11] and len(load.blocks) == 1 and load.reads_left == 0
    assert not any(isinstance(j, DiskRead) for j in pool.take_disk_jobs()), "nothing read from disk"
    assert disk.hashes() == [12, 13], "the disk's LRU order is as it was"
    assert pool.load_prefix([12], [2, 2, 9], 1, 11, lambda runs: 0) is None
    assert pool.num_free == 7


def test_a_worker_engine_chooses_with_its_cost_model_and_rates():
    def engine(**kw) -> Engine:
        ex = SimExecutor(COST, 1000, (), 4096, kv_bytes_per_token=LLAMA8B)
        return Engine(ex, None, EngineConfig("m", num_blocks=64, host_blocks=16, cost_model=COST, **kw))

    rb = engine().kv.read_back
    assert rb == ReadBack(COST, 16, LLAMA8B, 2048, 50.0, 0.5)
    assert engine(load_every_hit=True).kv.read_back is None
    assert engine(disk_gbps=4.0).kv.read_back.disk_gbps == 4.0


A, B = list(range(100, 149)), list(range(300, 413))  # 3 full blocks + 1 token; 7 + 1


def run_on(engine: Engine, *prompts: tuple[str, list[int]]) -> dict[str, int]:
    """Run `prompts` one after another on an engine stepped by hand: the tokens each reports cached."""
    cached: dict[str, int] = {}

    def sink(out) -> None:
        cached[out.request_id] = out.num_cached

    for rid, prompt in prompts:
        engine.submit(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), sink, detokenize=False)
        while engine.has_work():
            engine.step()
    return cached


def spilled(**config) -> Engine:
    """An engine (sim executor, the worker's cost model) on which prompt A ran and B then evicted
    A's blocks to the host tier."""
    engine = Engine(
        SimExecutor(COST, 1000, (), 4096, wait=lambda s: None, kv_bytes_per_token=LLAMA8B),
        None,
        EngineConfig("m", num_blocks=8, max_batched_tokens=256, host_blocks=16, cost_model=COST, **config),
    )
    run_on(engine, ("a", A), ("b", B))
    assert len(engine.pool.host) > 0
    return engine


def cached_on_return(**config) -> int:
    """The tokens A reports cached when it comes again after B spilled it to the host tier."""
    return run_on(spilled(**config), ("a-again", A))["a-again"]


def test_a_queued_hit_counts_the_slow_tier_blocks_its_worker_will_recompute_as_work():
    """A waiting for its turn after its blocks went to the host tier: its queued prefill is its
    last token's block alone where its worker copies the rest back (50 GB/s), the whole prompt
    where the worker will recompute it (10 MB/s), as the state's queued_prefill_tokens reads."""
    for gbps, every, queued in ((50.0, False, 1), (0.01, False, 49), (0.01, True, 1)):
        s = spilled(host_gbps=gbps, load_every_hit=every).scheduler
        s.add(Request("a-again", A, SamplingParams(max_tokens=1)))
        assert s.queued_prefill_tokens == queued, (gbps, every)


def test_an_engine_recomputes_what_its_host_link_is_too_slow_to_copy_back():
    assert cached_on_return() == 48, "at 50 GB/s the 3 blocks come back"
    assert cached_on_return(host_gbps=0.01) == 0, "at 10 MB/s they are recomputed"
    assert cached_on_return(host_gbps=0.01, load_every_hit=True) == 48


def test_the_router_predicts_the_same_choice():
    """20 host and 20 disk blocks matched: at 2 GB/s the worker reads the disk blocks back, at
    0.5 GB/s it recomputes them, and the router's hit, credit and copy time say so."""
    r, kv = req(64 * 16), dict(kv_bytes_per_token=LLAMA8B)
    for gbps, loaded in ((2.0, 40), (0.5, 20)):
        credits = TierCredits(host_gbps=50.0, disk_gbps=gbps)
        w = worker("w", matched_blocks=40, matched_host_blocks=20, matched_disk_blocks=20, tier_credits=credits, **kv)
        assert predict.tier_blocks(r, w) == (loaded, 20, loaded - 20)
        assert predict.hit_tokens(r, w) == predict.cached_tokens(r, w) == loaded * 16
        assert predict.copy_back_ms(r, w) == pytest.approx(copy_ms(20, loaded - 20, 16 * LLAMA8B, 50.0, gbps))


def published(**rates) -> WorkerView:
    """A worker's view as the gateway builds it from its /state (its JSON round trip), with the
    same 20 host and 20 disk blocks matched, the gateway's fallback disk rate 2 GB/s."""
    state = WorkerState.from_json(WorkerState("w", kv_bytes_per_token=LLAMA8B, **rates).to_json())
    view = worker_view(state, tiers=TierCredits(host_gbps=50.0, disk_gbps=2.0))
    return with_fields(view, matched_blocks=40, matched_host_blocks=20, matched_disk_blocks=20)


def test_the_router_predicts_each_worker_on_the_rates_it_publishes():
    """The same match on a worker that publishes a 2 GB/s disk and one that publishes 0.5 GB/s:
    the first is predicted to read its disk blocks back, the second to recompute them; a worker
    that publishes no rates (vLLM) is predicted on the gateway's, one that loads every hit never cuts."""
    r = req(64 * 16)
    fast, slow = published(host_gbps=50.0, disk_gbps=2.0), published(host_gbps=50.0, disk_gbps=0.5)
    assert (fast.tier_credits.disk_gbps, slow.tier_credits.disk_gbps) == (2.0, 0.5)
    assert predict.tier_blocks(r, fast) == (40, 20, 20) and predict.tier_blocks(r, slow) == (20, 20, 0)
    assert predict.cached_tokens(r, fast) == 640 and predict.cached_tokens(r, slow) == 320
    assert predict.copy_back_ms(r, fast) == pytest.approx(copy_ms(20, 20, 16 * LLAMA8B, 50.0, 2.0))
    assert predict.copy_back_ms(r, slow) == pytest.approx(copy_ms(20, 0, 16 * LLAMA8B, 50.0, 0.5))
    assert predict.tier_blocks(r, published()) == (40, 20, 20), "no rates published: the gateway's 2 GB/s"
    every = published(host_gbps=50.0, disk_gbps=0.5, load_every_hit=True)
    assert predict.tier_blocks(r, every) == (40, 20, 20)
    assert predict.copy_back_ms(r, every) == pytest.approx(copy_ms(20, 20, 16 * LLAMA8B, 50.0, 0.5))


def test_on_a_slow_disk_the_choice_keeps_the_slo_that_reading_every_hit_loses():
    """The disk tier's workload of test_simulate_tiers at 0.5 GB/s: reading every disk hit back
    costs 4.2 ms a block where a recompute costs ~1.3; the choice recomputes them."""
    attained = {}
    for every in (True, False):
        _, records = run(num_blocks=200, host_blocks=100, disk_blocks=600, disk_gbps=0.5, load_every_hit=every)
        assert all(r["error"] is None for r in records)
        attained[every] = summarize(records, 1000, 30)["slo_attainment"]
    assert attained[False] >= attained[True] and attained[False] > 0.95, attained


def test_where_reading_back_is_faster_the_choice_loads_everything_as_before():
    out = {}
    for every in (True, False):
        _, records = run(num_blocks=200, host_blocks=100, disk_blocks=600, disk_gbps=2.0, load_every_hit=every)
        out[every] = records
    assert out[True] == out[False]
