"""Scheduler and engine behaviour on the sim executor: budgets, chunking, preemption, aborts."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sim_engine import drain, sim_engine
from workers.kv.events import REMOVED, STORED
from workers.request import Request
from workers.sampling_params import SamplingParams


def collect(outs):
    return lambda o: outs.setdefault(o.request_id, []).append(o)


def test_token_budget_and_chunked_prefill():
    eng = sim_engine(max_batched_tokens=8)
    eng.submit("a", list(range(3, 23)), SamplingParams(max_tokens=2, ignore_eos=True), lambda o: None)
    eng._drain_inbox()
    plans = []
    for _ in range(3):
        plan = eng.scheduler.schedule()
        plans.append([(r.request_id, n) for r, n in plan.scheduled])
        for r, n in plan.scheduled:
            r.num_computed += n
            eng.kv.commit(r)
    assert plans == [[("a", 8)], [("a", 8)], [("a", 4)]], "20 prompt tokens in chunks of <= 8"


def test_running_decodes_go_before_new_prefills():
    eng = sim_engine(max_batched_tokens=8)
    eng.submit("a", list(range(3, 7)), SamplingParams(max_tokens=5, ignore_eos=True), lambda o: None)
    eng.step()
    eng.submit("b", list(range(10, 40)), SamplingParams(max_tokens=1, ignore_eos=True), lambda o: None)
    eng._drain_inbox()
    plan = eng.scheduler.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1), ("b", 7)]


def test_prefix_hit_never_covers_whole_prompt_and_reports_cached():
    eng = sim_engine()
    outs = {}
    prompt = list(range(3, 19))
    eng.submit("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True), collect(outs))
    drain(eng)
    eng.submit("b", prompt, SamplingParams(max_tokens=1, ignore_eos=True), collect(outs))
    drain(eng)
    assert outs["a"][-1].num_cached == 0
    assert outs["b"][-1].num_cached == 12, "16 tokens = 4 blocks, but the last must be computed"


def test_preemption_by_recompute_when_blocks_run_out():
    eng = sim_engine(num_blocks=12, block_size=4, max_batched_tokens=64)
    outs = {}
    for i in range(4):
        eng.submit(f"r{i}", [3 + i] * 8, SamplingParams(max_tokens=12, ignore_eos=True), collect(outs))
    drain(eng)
    assert eng.stats.preemptions > 0
    assert all(outs[f"r{i}"][-1].finish_reason == "length" for i in range(4))
    assert all(outs[f"r{i}"][-1].num_output == 12 for i in range(4))
    assert eng.pool.num_free == eng.pool.num_blocks


def test_preempted_output_equals_unpreempted_output():
    prompts = [[3 + i] * 8 for i in range(4)]
    results = []
    for blocks in (12, 200):
        eng = sim_engine(num_blocks=blocks, max_batched_tokens=64)
        outs = {}
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True), collect(outs))
        drain(eng)
        results.append({k: [t for o in v for t in o.token_ids] for k, v in outs.items()})
    assert results[0] == results[1]


def test_request_that_cannot_fit_finishes_with_length_instead_of_deadlock():
    eng = sim_engine(num_blocks=3, block_size=4)
    outs = {}
    eng.submit("big", list(range(3, 30)), SamplingParams(max_tokens=4), collect(outs))
    eng.submit("ok", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), collect(outs))
    drain(eng)
    assert outs["big"][-1].finish_reason == "length" and outs["ok"][-1].finish_reason == "length"
    assert eng.pool.num_free == 3


def test_abort_frees_blocks_at_once():
    eng = sim_engine()
    eng.submit("a", list(range(3, 40)), SamplingParams(max_tokens=100, ignore_eos=True), lambda o: None)
    eng.step()
    assert eng.pool.num_free < eng.pool.num_blocks
    eng.abort("a")
    eng.step()
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.has_work()


def test_stop_conditions():
    eng = sim_engine()
    outs = {}
    probe = {}
    eng.submit("probe", [3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True), collect(probe))
    drain(eng)
    toks = [t for o in probe["probe"] for t in o.token_ids]
    text = "".join(o.text for o in probe["probe"])
    eng.submit("tok", [3, 4, 5], SamplingParams(max_tokens=6, stop_token_ids=(toks[2],)), collect(outs))
    eng.submit("str", [3, 4, 5], SamplingParams(max_tokens=6, stop=(text[3:5],)), collect(outs))
    drain(eng)
    assert [t for o in outs["tok"] for t in o.token_ids] == toks[:3]
    assert outs["tok"][-1].finish_reason == "stop"
    assert "".join(o.text for o in outs["str"]) == text[: text.index(text[3:5])]
    assert outs["str"][-1].finish_reason == "stop"


def test_eos_stops_unless_ignored():
    eng = sim_engine()
    outs = {}
    real = eng.executor.execute
    eng.executor.execute = lambda chunks: [2 if t is not None else None for t in real(chunks)]
    eng.submit("eos", [3, 4], SamplingParams(max_tokens=3), collect(outs))
    eng.submit("ign", [3, 4], SamplingParams(max_tokens=3, ignore_eos=True), collect(outs))
    drain(eng)
    assert outs["eos"][-1].finish_reason == "stop" and outs["eos"][-1].num_output == 1
    assert outs["eos"][-1].text == "", "EOS is not part of the text"
    assert outs["ign"][-1].num_output == 3 and outs["ign"][-1].finish_reason == "length"


def test_events_match_pool_after_mixed_traffic():
    eng = sim_engine(num_blocks=20, block_size=4, max_batched_tokens=16)
    rng = random.Random(1)
    for i in range(30):
        eng.submit(
            f"r{i}",
            [rng.randrange(3, 50) for _ in range(rng.randrange(2, 30))],
            SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True),
            lambda o: None,
        )
    drain(eng)
    resident: set[int] = set()
    seqs = []
    for e in eng.events.after(0).events:
        seqs.append(e.seq)
        if e.kind == STORED:
            resident |= set(e.hashes)
        elif e.kind == REMOVED:
            resident -= set(e.hashes)
    assert seqs == list(range(1, len(seqs) + 1))
    assert resident == set(eng.pool.resident_hashes())


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 30), st.booleans(), st.integers(0, 6)), min_size=1, max_size=25
    ),
    st.integers(6, 30),
    st.integers(4, 64),
    st.integers(1, 8),
)
def test_any_mix_drains_with_all_blocks_free(reqs, num_blocks, budget, max_seqs):
    """Finished, aborted and preempted requests all give their blocks back; nothing deadlocks."""
    eng = sim_engine(num_blocks=num_blocks, block_size=4, max_batched_tokens=budget, max_num_seqs=max_seqs)
    outs = {}
    shared = list(range(3, 20))
    for i, (plen, mt, abort, delay) in enumerate(reqs):
        eng.submit(
            f"r{i}",
            (shared + list(range(100, 100 + plen)))[: plen + (i % 3) * 4],
            SamplingParams(max_tokens=mt, ignore_eos=True),
            collect(outs),
        )
        for _ in range(delay):
            eng.step()
        if abort:
            eng.abort(f"r{i}")
    drain(eng)
    assert eng.pool.num_free == eng.pool.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting
    capacity = num_blocks * 4
    for i, (plen, mt, abort, _) in enumerate(reqs):
        last = outs[f"r{i}"][-1]
        assert last.finish_reason in (("abort", "length") if abort else ("length",))
        if not abort:
            fits = plen + (i % 3) * 4 + mt <= capacity
            assert last.num_output == mt or not fits, "only a request larger than the pool is cut short"


def test_request_token_bookkeeping():
    r = Request("x", [1, 2, 3], SamplingParams())
    assert r.num_tokens == 3 and r.output_ids == [] and r.is_prefilling
    r.num_computed = 3
    r.token_ids.append(9)
    assert r.output_ids == [9] and r.num_remaining == 1 and not r.is_prefilling


def test_prefix_match_of_a_preempted_request_leaves_a_token_to_compute():
    """A request whose hash chain already covers every token (e.g. after preemption with a
    block-aligned length) still computes its last token, never the empty remainder."""
    eng = sim_engine(num_blocks=32, block_size=4)
    prompt = list(range(3, 11))
    eng.submit("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True), lambda o: None)
    drain(eng)
    req = Request("b", prompt, SamplingParams(max_tokens=1))
    eng.kv._hashes(req, 2)
    assert len(req.block_hashes) == 2
    assert eng.kv.match_prefix(req) == 4 and req.num_remaining == 4


def test_a_waiting_prefix_hit_queues_only_its_uncached_tokens():
    eng = sim_engine(num_blocks=64, block_size=4, max_batched_tokens=64)
    prefix = list(range(3, 35))  # 8 full blocks
    eng.submit("warm", prefix + [40, 41], SamplingParams(max_tokens=1, ignore_eos=True), lambda o: None)
    drain(eng)
    eng.submit("hit", prefix + [50, 51, 52], SamplingParams(max_tokens=1, ignore_eos=True), lambda o: None)
    eng.submit("cold", list(range(100, 135)), SamplingParams(max_tokens=1, ignore_eos=True), lambda o: None)
    eng._drain_inbox()
    assert eng.scheduler.queued_prefill_tokens == 3 + 35, "the hit's 32 cached tokens are not queued work"
    drain(eng)
    assert eng.scheduler.queued_prefill_tokens == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 12), st.booleans(), st.integers(0, 6)), min_size=1, max_size=25
    ),
    st.integers(8, 30),
    st.integers(1, 40),
    st.integers(1, 4),
)
def test_any_mix_with_slow_copies_back_drains_with_both_tiers_free(reqs, num_blocks, host_blocks, copy_steps):
    """With a host tier whose copies back take several steps: requests that wait for theirs,
    are aborted while waiting, finish or are preempted all give every block back in both tiers."""
    eng = sim_engine(
        num_blocks=num_blocks, block_size=4, max_batched_tokens=16, copy_steps=copy_steps, host_blocks=host_blocks
    )
    outs = {}
    prompts = [list(range(10 * g, 10 * g + 21)) for g in range(4)]  # 5 full blocks each, a few shared ways
    for i, (group, mt, abort, delay) in enumerate(reqs):
        eng.submit(f"r{i}", prompts[group] + [900 + i], SamplingParams(max_tokens=mt, ignore_eos=True), collect(outs))
        for _ in range(delay):
            eng.step()
        if abort:
            eng.abort(f"r{i}")
    drain(eng)
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.pool.releasing
    host = eng.pool.host
    assert host.num_free + len(host) == host.num_slots and not host.num_draining
    assert not eng.scheduler.loading and not eng.copies.copying
    for i, (_, mt, abort, _) in enumerate(reqs):
        last = outs[f"r{i}"][-1]
        assert last.finish_reason in (("abort", "length") if abort else ("length",))
        assert abort or last.num_output == mt or 22 + mt > num_blocks * 4, "only a request larger than the pool is cut"
