"""The host tier (workers/kv/host_pool.py): evicted device blocks spill to host slots by hash and
come back on a prefix hit. Residency and copies are checked against a shadow of the bytes under
random operations; a device -> host -> device round trip gives transformers' greedy output."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from workers.engine import Engine, EngineConfig
from workers.executors.torch_runner import TorchRunner
from workers.kv.block_pool import BlockPool
from workers.kv.events import HOST, REMOVED, STORED, EventLog
from workers.kv.hashing import block_hashes
from workers.kv.host_pool import SWAP_IN, SWAP_OUT, HostPool
from workers.model_store import load_tokenizer, resolve
from workers.sampling_params import SamplingParams

B = 2


def host_pool(num_blocks: int, num_slots: int) -> BlockPool:
    log = EventLog("w")
    return BlockPool(num_blocks, B, log, HostPool(num_slots, log))


def test_an_evicted_block_spills_to_host_and_loads_back_into_a_fresh_block():
    pool = host_pool(2, 4)
    a = pool.allocate(1)
    pool.register(a, [11], [(1, 2)], None)
    pool.free(a)
    pool.allocate(2)  # evicts block 0 (hash 11)
    assert pool.lookup(11, (1, 2)) is None and pool.host_hashes() == [11]
    [batch] = pool.take_copies()
    assert (batch.direction, batch.block_ids, batch.slots) == (SWAP_OUT, [0], [0])
    assert pool.load_prefix([11], [9, 9], 0, None) == [], "tokens are re-checked: a collision is a miss"


def test_load_prefix_stops_where_the_device_has_no_room():
    pool = host_pool(3, 4)
    blocks = pool.allocate(3)
    pool.register(blocks, [1, 2, 3], [(1, 1), (2, 2), (3, 3)], None)
    pool.free(blocks)
    held = pool.allocate(3)  # all three spill
    pool.free(held[:1])
    loaded = pool.load_prefix([1, 2, 3], [1, 1, 2, 2, 3, 3], 0, None)
    assert [b.hash for b in loaded] == [1]
    copies = pool.take_copies()
    assert [c.direction for c in copies] == [SWAP_OUT, SWAP_IN]


def replay(events, medium: str) -> set[int]:
    held: set[int] = set()
    for e in events:
        if e.medium != medium and e.kind != "cleared":
            continue
        if e.kind == STORED:
            held |= set(e.hashes)
        elif e.kind == REMOVED:
            held -= set(e.hashes)
        else:
            held.clear()
    return held


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "free", "reg", "load", "clear"]), st.integers(0, 6)), max_size=80),
    st.integers(0, 5),
)
def test_tiers_keep_totals_and_never_serve_a_block_whose_slot_was_reused(ops, num_slots):
    """A shadow of every device block's and host slot's bytes follows the queued copies; a block
    loaded from host must then hold its hash's tokens, and both tiers' counts add up."""
    pool = host_pool(6, num_slots)
    device: dict[int, tuple] = {}
    host: dict[int, tuple] = {}
    held: list = []
    made: dict[int, tuple] = {}  # every hash registered so far -> its tokens

    def flush() -> None:
        for batch in pool.take_copies():
            for bid, slot in zip(batch.block_ids, batch.slots):
                if batch.direction == SWAP_OUT:
                    host[slot] = device.get(bid)
                else:
                    device[bid] = host.get(slot)

    for op, n in ops:
        if op == "alloc" and pool.can_allocate(n):
            new = pool.allocate(n)
            flush()
            for b in new:
                device[b.block_id] = ("garbage", b.block_id)  # a step writes other K/V there
            held += new
        elif op == "free" and held:
            k = min(len(held), n + 1)
            pool.free(held[:k])
            held = held[k:]
        elif op == "reg" and held and held[n % len(held)].hash is None:  # a block is filled once
            b = held[n % len(held)]
            h = len(made) + 1
            made[h] = (h, n)
            device[b.block_id] = made[h]
            pool.register([b], [h], [made[h]], None)
        elif op == "load" and made:
            h = list(made)[n % len(made)]
            loaded = pool.load_prefix([h], list(made[h]), 0, None)
            flush()
            for b in loaded:
                assert device[b.block_id] == made[h], "a block came back with other bytes"
            held += loaded
        elif op == "clear":
            pool.clear_cache()
            flush()
        assert pool.num_free + len({b.block_id for b in held}) == pool.num_blocks
        assert pool.host.num_free + len(pool.host) == num_slots
    pool.free(held)
    assert pool.num_free == pool.num_blocks, "device blocks return to the total"
    assert len({e.slot for e in pool.host._entries.values()}) == len(pool.host), "one entry per slot"
    events = pool.events.after(0).events
    assert replay(events, "device") == set(pool.resident_hashes())
    assert replay(events, HOST) == set(pool.host_hashes()), "host events replay to the host tier"


# A device -> host -> device round trip on real models

NEW = 4


@functools.cache
def hf_greedy(path: str, prompt: tuple[int, ...]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
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
