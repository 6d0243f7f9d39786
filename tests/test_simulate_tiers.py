"""The fleet simulator with the block pool's host and disk tiers: the same records stepped or
fast-forwarded, the router's index mirrors every tier of every worker, blocks come back, a host
tier under a device pool too small for the working set turns recomputed prefixes into hits, and
a disk tier under a host tier too small does the same for what the host loses."""

from bench.fleet_sim import FleetConfig, FleetSim
from bench.report import summarize
from bench.sim_worker import SimConfig
from bench.workloads import WorkloadConfig, generate
from policies.registry import load_policy
from workers.kv.events import DISK, HOST

WL = WorkloadConfig(
    name="shared-prefix", rate=20, duration_s=15, seed=0, groups=32, prefix_len=1024, question_len=32, output_len=16
)


def run(policy: str = "prefix_affinity", wl: WorkloadConfig = WL, **sim) -> tuple[FleetSim, list[dict]]:
    fleet = FleetConfig(workers=4, sim=SimConfig(**sim), slo_ttft_ms=1000, slo_tpot_ms=30)
    s = FleetSim(load_policy(policy), fleet)
    return s, sorted(s.run(generate(wl), wl.duration_s), key=lambda r: r["arrival_s"])


def test_fast_forward_is_exact_with_a_host_tier():
    wl = WorkloadConfig(name="multi-turn", rate=15, duration_s=10, seed=2)
    fast, a = run(wl=wl, num_blocks=300, host_blocks=600)
    _, b = run(wl=wl, num_blocks=300, host_blocks=600, fast_forward=False)
    assert a == b and len(a) > 100 and all(r["error"] is None for r in a)
    assert any(len(w.pool.host) for w in fast.workers), "the host tier was used"


def test_index_mirrors_both_tiers_and_blocks_come_back():
    s, records = run(num_blocks=400, host_blocks=300)
    s._index_events()
    for w in s.workers:
        assert s.index.num_blocks(w.worker_id) == len(w.pool.resident_hashes())
        assert s.index.num_blocks(w.worker_id, HOST) == len(w.pool.host) > 0
        assert w.pool.num_free == w.pool.num_blocks, "every device block is free once all requests ended"
        assert w.pool.host.num_free + len(w.pool.host) == w.pool.host.num_slots
    assert all(r["error"] is None for r in records)


def test_a_host_tier_turns_evicted_prefixes_into_hits():
    """32 prefixes of 64 blocks over 4 workers (512 blocks each with affinity); device pools of
    200 blocks hold about a third of that, a host tier of 600 the rest."""
    ratio = {}
    for host in (0, 600):
        _, records = run(num_blocks=200, host_blocks=host)
        ratio[host] = summarize(records, 1000, 30)["cached_token_ratio"]
    assert ratio[600] > ratio[0] + 0.2, ratio


def test_fast_forward_is_exact_with_a_disk_tier():
    wl = WorkloadConfig(name="multi-turn", rate=15, duration_s=10, seed=2)
    fast, a = run(wl=wl, num_blocks=300, host_blocks=200, disk_blocks=600)
    _, b = run(wl=wl, num_blocks=300, host_blocks=200, disk_blocks=600, fast_forward=False)
    assert a == b and len(a) > 100 and all(r["error"] is None for r in a)
    assert any(len(w.pool.disk) for w in fast.workers), "the disk tier was used"


def test_a_disk_tier_under_a_small_host_tier_turns_its_losses_into_hits():
    """The same 32 prefixes of 64 blocks: device pools of 200 blocks and host tiers of 100 hold
    about 60% of each worker's share; a disk tier of 600 holds the rest. Every tier's blocks are
    in the router's index and free blocks return to the totals."""
    ratio = {}
    for disk in (0, 600):
        s, records = run(num_blocks=200, host_blocks=100, disk_blocks=disk, disk_gbps=2.0)
        ratio[disk] = summarize(records, 1000, 30)["cached_token_ratio"]
        assert all(r["error"] is None for r in records)
    s._index_events()
    for w in s.workers:
        assert s.index.num_blocks(w.worker_id, DISK) == len(w.pool.disk) > 0
        assert w.pool.num_free == w.pool.num_blocks and w.pool.host.num_free + len(w.pool.host) == 100
    assert ratio[600] > ratio[0] + 0.1, ratio
