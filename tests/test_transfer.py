"""The KV transfer format: round trip, and every way a bad transfer is refused."""

import pytest

from tests.sim_engine import drain, sim_engine
from workers.kv.hashing import block_hashes, seed_hash
from workers.sampling_params import InvalidRequest, SamplingParams
from workers.transfer import KVSpec, decode, encode_header, import_payload, publish, reserve

SPEC = KVSpec("m", 4, "float32", 2, 1, 2)
SEED = seed_hash("m", 4)


def transfer(tokens, spec=SPEC, payload=None, hashes=None):
    blocks = [tokens[i : i + 4] for i in range(0, len(tokens) - len(tokens) % 4, 4)]
    hashes = block_hashes(tokens, 4, SEED) if hashes is None else hashes
    data = payload if payload is not None else bytes(range(256))[:1] * (spec.block_bytes() * len(blocks))
    return encode_header(spec, hashes, blocks, None) + data, hashes, blocks


def test_round_trip():
    body, hashes, blocks = transfer(list(range(12)))
    p = decode(body, SPEC, SEED)
    assert p.hashes == hashes and p.tokens == blocks and len(p.data) == 3 * SPEC.block_bytes()


@pytest.mark.parametrize("case", ["magic", "spec", "size", "hash", "tokens"])
def test_bad_transfers_are_client_errors(case):
    toks = list(range(8))
    if case == "magic":
        body = b"XXXX" + transfer(toks)[0][4:]
    elif case == "spec":
        body = transfer(toks, spec=KVSpec("m", 4, "bfloat16", 2, 1, 2))[0]
    elif case == "size":
        body = transfer(toks)[0][:-3]
    elif case == "hash":
        hs = block_hashes(toks, 4, SEED)
        body = transfer(toks, hashes=[hs[0], hs[1] ^ 1])[0]
    else:
        hs = block_hashes(toks, 4, SEED)
        body = encode_header(SPEC, hs, [toks[:4], toks[4:7]], None) + b"\0" * 2 * SPEC.block_bytes()
    with pytest.raises(InvalidRequest):
        decode(body, SPEC, SEED)


def test_import_populates_prefix_cache_and_emits_stored_events():
    eng = sim_engine(num_blocks=16, block_size=4)
    prompt = list(range(3, 20))
    spec = KVSpec("m", 4, "none", 0, 0, 0)
    hashes = block_hashes(prompt, 4, eng.kv.seed)
    body = encode_header(spec, hashes, [prompt[i : i + 4] for i in range(0, 16, 4)], None)
    imported, present = import_payload(eng.pool, eng.executor, decode(body, spec, eng.kv.seed))
    assert (imported, present) == (4, 0)
    assert [e.hashes for e in eng.events.after(0).events] == [tuple(hashes)]
    assert eng.pool.num_free == 16, "imported blocks are cached, not held"
    outs = []
    eng.submit("r", prompt, SamplingParams(max_tokens=2, ignore_eos=True), outs.append)
    drain(eng)
    assert outs[-1].num_cached == 16
    assert import_payload(eng.pool, eng.executor, decode(body, spec, eng.kv.seed)) == (0, 4)


def test_decode_leg_falls_back_when_blocks_never_arrive():
    eng = sim_engine()
    outs = []
    eng.submit("r", list(range(3, 30)), SamplingParams(max_tokens=2, ignore_eos=True), outs.append, kv_wait_s=0.05)
    drain(eng)
    assert outs[-1].finish_reason == "length" and outs[-1].num_output == 2
    assert eng.stats.kv_fallbacks == 1 and eng.pool.num_free == eng.pool.num_blocks


def test_reserved_blocks_are_invisible_until_published_and_a_failed_write_leaks_nothing():
    eng = sim_engine(num_blocks=16, block_size=4)
    prompt = list(range(3, 20))
    spec = KVSpec("m", 4, "none", 0, 0, 0)
    hashes = block_hashes(prompt, 4, eng.kv.seed)
    payload = decode(encode_header(spec, hashes, [prompt[i : i + 4] for i in range(0, 16, 4)], None), spec, eng.kv.seed)
    res = reserve(eng.pool, payload)
    assert len(res.fresh) == 4 and res.positions == [0, 1, 2, 3] and eng.pool.num_free == 12
    assert eng.pool.lookup(hashes[0], tuple(prompt[:4])) is None, "not cached before publish"
    assert not eng.events.after(0).events
    eng.pool.free(res.blocks)  # what the receiver does when the write fails
    assert eng.pool.num_free == 16 and not eng.events.after(0).events
    assert import_payload(eng.pool, eng.executor, payload) == (4, 0)
    res = reserve(eng.pool, payload)
    assert res.fresh == [] and len(res.blocks) == 4, "resident blocks are touched, not rewritten"
    assert publish(eng.pool, payload, res) == (0, 4) and eng.pool.num_free == 16


def test_a_failed_kv_write_is_a_500_and_leaks_nothing():
    """The K/V write runs off the engine thread; when it fails the reserved blocks go back
    unpublished and the sender gets an OpenAI-shaped error."""
    from starlette.testclient import TestClient

    from workers.server import WorkerServer

    eng = sim_engine(num_blocks=16, block_size=4)

    def broken(*args):
        raise RuntimeError("device lost")

    eng.executor.import_blocks = broken
    server = WorkerServer(eng, "m", vocab_size=1000, internal_token="t")
    prompt = list(range(3, 20))
    spec = KVSpec("m", 4, "none", 0, 0, 0)
    body = encode_header(spec, block_hashes(prompt, 4, eng.kv.seed), [prompt[i : i + 4] for i in range(0, 16, 4)], None)
    eng.start()
    with TestClient(server.app) as client:
        r = client.post("/kv/import", content=body, headers={"x-kvgate-token": "t"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "kv_import_failed"
        state = client.get("/state", headers={"x-kvgate-token": "t"}).json()
    assert eng.pool.num_free == 16 and not eng.events.after(0).events
    assert state["engine_calls_s"] >= 0


def test_exports_not_sent_yet_count_as_the_links_backlog():
    """`kv_transfer.backlog_bytes` (what the predictor puts ahead of a new export on this link)
    is the K/V bytes of the exports handed over and not finished, sent or failed."""
    import asyncio

    from workers.transfer_http import TransferService

    eng = sim_engine()
    svc = TransferService(eng, "m", "token")
    svc.spec = SPEC
    gates: list[asyncio.Event] = []

    async def send(*args, **kwargs) -> bool:
        gate = asyncio.Event()
        gates.append(gate)
        await gate.wait()
        if gate is gates[1]:
            raise RuntimeError("the peer went away")
        return True

    svc.send = send

    async def run() -> list[int]:
        seen = []
        for n in (3, 5):
            svc._start_send("http://d", list(range(n)), [[0] * 4] * n, [], None)
        await asyncio.sleep(0)
        seen.append(svc.stats()["backlog_bytes"])
        for gate in gates:
            gate.set()
            await asyncio.sleep(0.01)
            seen.append(svc.backlog_bytes)
        return seen

    assert asyncio.run(run()) == [8 * SPEC.block_bytes(), 5 * SPEC.block_bytes(), 0]
    assert svc.sending == 0 and svc.failures == 1
