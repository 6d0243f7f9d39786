"""The host tier (workers/kv/host_pool.py): evicted device blocks spill to host slots by hash and
come back on a prefix hit. Residency and copies are checked against a shadow of the bytes under
random operations; a device -> host -> device round trip gives transformers' greedy output."""

import functools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from workers.config import EngineConfig
from workers.engine import Engine
from workers.executors.torch_runner import TorchRunner
from workers.kv.block_pool import BlockPool
from workers.kv.events import HOST, EventLog
from workers.kv.hashing import block_hashes
from workers.kv.host_pool import SWAP_IN, SWAP_OUT, HostPool
from workers.model_store import load_tokenizer, resolve
from workers.sampling_params import SamplingParams
from tests.sim_engine import SlowCopies, sim_engine
from tests.tier_shadow import TierShadow
from tests.tier_events import replay

B = 2


def host_pool(num_blocks: int, num_slots: int) -> BlockPool:
    log = EventLog("w")
    return BlockPool(num_blocks, B, log, HostPool(num_slots, log))


def test_an_evicted_block_spills_to_host_and_loads_back_into_a_fresh_block():
    pool = host_pool(2, 4)
    a = pool.allocate(1)
    pool.register(a, [11], [(1, 2)], None)
    pool.free(a)
    taken = pool.allocate(2)  # evicts block 0 (hash 11)
    assert pool.lookup(11, (1, 2)) is None and pool.host_hashes() == [11]
    [batch] = pool.take_copies()
    assert (batch.direction, batch.block_ids, batch.slots) == (SWAP_OUT, [0], [0])
    pool.free(taken)
    assert pool.load_prefix([11], [9, 9], 0, None) is None, "tokens are re-checked: a collision is a miss"
    load = pool.load_prefix([11], [1, 2], 0, None)
    assert load is not None and load.slots == [0]
    assert pool.lookup(11, (1, 2)) is None, "a block being copied back is no hit before it lands"
    load.done = True
    pool.land(load)
    assert pool.lookup(11, (1, 2)) is load.blocks[0]


def test_load_prefix_stops_where_the_device_has_no_room():
    pool = host_pool(3, 4)
    blocks = pool.allocate(3)
    pool.register(blocks, [1, 2, 3], [(1, 1), (2, 2), (3, 3)], None)
    pool.free(blocks)
    held = pool.allocate(3)  # all three spill
    pool.free(held[:1])
    load = pool.load_prefix([1, 2, 3], [1, 1, 2, 2, 3, 3], 0, None)
    assert load is not None and load.hashes == [1]
    copies = pool.take_copies()
    assert [c.direction for c in copies] == [SWAP_OUT, SWAP_IN]


def test_a_slot_being_copied_back_is_never_reused():
    """LRU passes over pinned slots; a tier whose every slot is pinned keeps nothing new, and a
    clear frees a pinned slot only once its copy is done."""
    pool = host_pool(2, 1)
    a = pool.allocate(1)
    pool.register(a, [11], [(1, 2)], None)
    pool.free(a)
    pool.free(pool.allocate(2))  # 11 spills into the only slot
    load = pool.load_prefix([11], [1, 2], 0, None)
    assert load is not None
    b = pool.allocate(1)
    pool.register(b, [12], [(3, 4)], None)
    pool.free(b)
    pool.allocate(1)  # 12 is evicted from the device and cannot have the pinned slot
    assert pool.host_hashes() == [11]
    pool.clear_cache()
    assert pool.host.num_free == 0 and pool.host.num_draining == 1
    load.done = True
    pool.land(load)
    assert pool.host.num_free == 1 and pool.lookup(11, (1, 2)) is None, "a load cut by a clear is never cached"


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "reg", "cache", "load", "land", "abort", "clear"]), st.integers(0, 6)
        ),
        max_size=80,
    ),
    st.integers(0, 3),
)
@example(  # a slot being copied back from, wanted by LRU for a block evicted meanwhile
    [("cache", 0), ("alloc", 6), ("free", 6), ("load", 0), ("cache", 0), ("alloc", 5), ("land", 0)], 1
)
def test_tiers_keep_totals_and_never_serve_a_block_whose_slot_was_reused(ops, num_slots):
    """A shadow of every device block's and host slot's bytes follows the copies: copies out at
    once, a copy back as late as it may run (when its load lands), so a slot reused meanwhile
    would show. A landed block must hold its hash's tokens, a block being copied back is never
    a hit, and both tiers' counts add up with loads in flight and loads whose request ended."""
    pool = host_pool(6, num_slots)
    s = TierShadow(pool, num_slots)
    made: dict[int, tuple] = {}  # every hash registered so far -> its tokens

    for op, n in ops:
        if op == "alloc":
            s.alloc(n)
        elif op == "free":
            s.free(n)
        elif op == "reg" and s.held and s.held[n % len(s.held)].hash is None:  # a block is filled once
            b = s.held[n % len(s.held)]
            h = len(made) + 1
            made[h] = (h, n)
            s.device[b.block_id] = made[h]
            pool.register([b], [h], [made[h]], None)
        elif op == "cache" and pool.can_allocate(1):  # a block filled and let go: cached, evictable
            [b] = pool.allocate(1)
            s.flush()
            h = len(made) + 1
            made[h] = s.device[b.block_id] = (h, n)
            pool.register([b], [h], [made[h]], None)
            pool.free([b])
        elif op == "load" and made:
            h = list(made)[n % len(made)]
            load = pool.load_prefix([h], list(made[h]), 0, None)
            s.flush()
            if load is not None:
                assert pool.lookup(h, made[h]) not in load.blocks, "no hit on a block being copied back"
                s.loading.append(load)
        elif op == "land" and (s.loading or s.released):
            load = s.land(n)
            for b, h in zip(load.blocks, load.hashes):
                assert s.device[b.block_id] == made[h], "a block came back with other bytes"
        elif op == "abort":
            s.abort(n)
        elif op == "clear":
            pool.clear_cache()
            s.flush()
        s.check_totals()
    s.drain()
    assert pool.num_free == pool.num_blocks and not pool.releasing, "device blocks return to the total"
    assert pool.host.num_free + len(pool.host) == num_slots and not pool.host.num_draining
    assert len({e.slot for e in pool.host._entries.values()}) == len(pool.host), "one entry per slot"
    events = pool.events.after(0).events
    assert replay(events, "device") == set(pool.resident_hashes())
    assert replay(events, HOST) == set(pool.host_hashes()), "host events replay to the host tier"


# A device -> host -> device round trip on real models

NEW = 4


@functools.cache
def hf_model(path: str):
    """transformers' model at `path`, loaded once for every prompt (here and in test_disk_tier_worker)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@functools.cache
def hf_greedy(path: str, prompt: tuple[int, ...]) -> list[int]:
    model = hf_model(path)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2"])
def model_path(request, tiny_llama) -> str:
    return str(resolve("smollm2-135m")) if request.param == "smollm2" else str(tiny_llama)


def run(engine: Engine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    outs: list = []
    engine.submit(
        rid, prompt, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), outs.append, detokenize=False
    )
    while engine.has_work():
        engine.step()
    return [t for o in outs for t in o.token_ids], outs[-1].num_cached


def test_round_trip_through_host_matches_transformers(model_path):
    """A's blocks are evicted by B (whose prefill overwrites them), stored in host, and loaded
    back for A again: the reloaded K/V is bit-identical and the output is transformers'."""
    tok = load_tokenizer(model_path)
    a = tok.encode("The quick brown fox jumps over the lazy dog while the cache keeps every block it can. " * 3)[:30]
    b = tok.encode("Paged attention splits the key value cache into blocks that a scheduler hands out. " * 3)[:30]
    assert len(a) == len(b) == 30
    block, blocks = 4, 10
    runner = TorchRunner(model_path, blocks, block)
    engine = Engine(runner, tok, EngineConfig("m", block, blocks, 64, 8, host_blocks=32))
    first, cached = run(engine, "a1", a)
    assert cached == 0
    hashes = block_hashes(a, block, engine.kv.seed)[: (len(a) - 1) // block]
    chunks = [tuple(a[i * block : (i + 1) * block]) for i in range(len(hashes))]
    before = {h: runner.read_blocks([engine.pool.lookup(h, t).block_id]).clone() for h, t in zip(hashes, chunks)}
    run(engine, "b", b)
    spilled = [h for h, t in zip(hashes, chunks) if engine.pool.lookup(h, t) is None]
    assert spilled and set(spilled) <= set(engine.pool.host_hashes()), "B's prefill evicted A's blocks to host"
    loaded = engine.stats.host_loaded_blocks
    again, cached = run(engine, "a2", a)
    assert cached == len(hashes) * block, "the whole prefix is a hit, device and host"
    assert engine.stats.host_loaded_blocks - loaded == len(spilled) and engine.stats.host_stored_blocks >= len(spilled)
    for h, t in zip(hashes, chunks):
        assert torch.equal(runner.read_blocks([engine.pool.lookup(h, t).block_id]), before[h])
    assert first == again == hf_greedy(model_path, tuple(a))


# A copy back that takes several steps: the request waits for it, nothing else does

COPY_STEPS = 3


class SlowCopyRunner(SlowCopies, TorchRunner):
    def launch(self, chunks):
        self.tick()
        return super().launch(chunks)


def wait_for_copy_back(engine: Engine, a: list[int], b: list[int], c: list[int]) -> tuple[dict, list]:
    """A runs; B's prefill evicts A's blocks to host; C decodes while A runs again and waits for
    its blocks to come back. Returns each request's tokens and number of cached tokens, and per
    step that ended with A still waiting, the requests it gave a token to."""
    outs: dict[str, list] = {}

    def submit(rid: str, prompt: list[int], n: int) -> None:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.submit(rid, prompt, params, outs.setdefault(rid, []).append, detokenize=False)

    for rid, prompt in (("a", a), ("b", b)):
        submit(rid, prompt, NEW)
        while engine.has_work():
            engine.step()
    submit("c", c, 3 * NEW)
    engine.step()
    submit("a2", a, NEW)
    waited = []
    while engine.has_work():
        stepped = [o.request_id for o in engine.step() if o.token_ids]
        if engine.scheduler.loading:
            waited.append(stepped)
    tokens = {rid: ([t for o in got for t in o.token_ids], got[-1].num_cached) for rid, got in outs.items()}
    return tokens, waited


def check_waited(engine: Engine, tokens: dict, waited: list, a: list[int]) -> None:
    assert len(waited) >= COPY_STEPS, "A waited for its copy back"
    assert all(stepped == ["c"] for stepped in waited), "C got a token every step A waited, A none"
    B = engine.config.block_size
    assert tokens["a2"] == (tokens["a"][0], (len(a) - 1) // B * B), "A's prefix came back whole, same tokens"
    assert engine.stats.host_loaded_blocks > 0 and engine.pool.num_free == engine.pool.num_blocks
    host = engine.pool.host
    assert host.num_free + len(host) == host.num_slots and not engine.pool.releasing


def test_a_request_waiting_for_its_copy_back_holds_up_nothing_else():
    engine = sim_engine(num_blocks=16, block_size=4, copy_steps=COPY_STEPS, host_blocks=32)
    a, b, c = list(range(3, 24)), list(range(100, 157)), list(range(200, 204))
    tokens, waited = wait_for_copy_back(engine, a, b, c)
    check_waited(engine, tokens, waited, a)


class SlowCopyOverlapRunner(SlowCopyRunner):
    """The runner's own launch/collect overlapped on CPU (the next step planned before this
    one's tokens are read, as on CUDA)."""

    overlaps = True


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_copy_back_overlapping_other_requests_keeps_greedy_output(model_path, overlap):
    """The same on a real model, stepped one at a time or overlapped: A's and C's tokens are
    transformers' greedy ones."""
    tok = load_tokenizer(model_path)
    a = tok.encode("The quick brown fox jumps over the lazy dog while the cache keeps every block it can. " * 3)[:21]
    b = tok.encode("Paged attention splits the key value cache into blocks that a scheduler hands out. " * 3)[:57]
    c = tok.encode("A gateway routes each request to the worker that holds its prefix.")[:8]
    runner = (SlowCopyOverlapRunner if overlap else SlowCopyRunner)(model_path, 16, 4, copy_steps=COPY_STEPS)
    engine = Engine(runner, tok, EngineConfig("m", 4, 16, 64, 8, host_blocks=32))
    tokens, waited = wait_for_copy_back(engine, a, b, c)
    check_waited(engine, tokens, waited, a)
    assert tokens["a"][0] == hf_greedy(model_path, tuple(a))
    assert tokens["c"][0][:NEW] == hf_greedy(model_path, tuple(c))
