"""A NIXL WRITE cannot be taken back, so a decode worker never frees for reuse a block that a
WRITE may still land in (workers/transfer_nixl.py). In one process, with fake agents (the bytes'
landing is a callback) and a real engine holding the decode side's blocks: a reservation that
expires during a slow WRITE, a writer that fails without knowing whether its bytes are still
in flight (its export then goes by HTTP), one that hangs mid-WRITE, and one that never answers.
Each time: no block is reused while it may be written, nothing unproven is published, and
every block is back in the pool once the quarantine's bound has passed."""

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
from starlette.applications import Starlette

from gateway.procs import wait_for, wait_until
from tests.sim_engine import sim_engine
from tests.test_metrics import samples
from tests.test_worker_fields import malformed
from workers import transfer_nixl
from workers.kv.hashing import block_hashes
from workers.transfer import encode_header
from workers.metrics import WorkerMetrics
from workers.transfer_http import TransferService
from workers.transfer_metrics import TransferCollector
from workers.nixl_agent import NixlError
from workers.nixl_layout import CacheLayout
from workers.transfer_nixl import NixlTransfer

TOKEN = "quarantine-token"
TTL_S = 1.0  # a reservation's lifetime here: the checks inside it have half of it to spare
PROMPT = list(range(10, 22))  # 3 blocks of 4 tokens
HEADERS = {"x-kvgate-token": TOKEN}


class FakeAgent:
    """The NIXL agent's surface that NixlTransfer uses; `write` runs `on_write` on its thread."""

    def __init__(self, name: str, num_blocks: int, on_write=None):
        self.name = name
        self.layout = CacheLayout(name, "", "DRAM", 0, 0, num_blocks, 2, 8)
        self.on_write = on_write

    def progress(self) -> None:
        pass

    def forget(self, agent: str) -> None:
        pass

    def write(self, peer: CacheLayout, local: list[int], remote: list[int], deadline: float) -> int:
        return self.on_write(remote)


class Pair:
    """A decode worker's NIXL side (a real engine's pool) behind an in-process ASGI client, and
    a prefill worker's NIXL side whose WRITE is `on_write(granted block ids)`."""

    def __init__(self, on_write, quarantine_s: float | None = None):
        self.engine = sim_engine(num_blocks=16, block_size=4)
        self.engine.start()
        self.service = TransferService(self.engine, "m", TOKEN)
        self.decode = self.service.nixl = NixlTransfer(self.service, FakeAgent("d", 16), quarantine_s)
        writer_service = SimpleNamespace(token=TOKEN, count_sent=lambda *sent: None)
        self.prefill = NixlTransfer(writer_service, FakeAgent("p", 16, on_write))
        app = Starlette(routes=self.service.routes())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d")
        hashes = block_hashes(PROMPT, 4, self.engine.kv.seed)
        self.header = encode_header(self.service.spec, hashes, [PROMPT[i : i + 4] for i in (0, 4, 8)], None)

    def pool(self, fn):
        """`fn(pool)` on the engine thread."""
        return self.engine.call(lambda: fn(self.engine.pool)).result(timeout=10)

    def held_unpublished(self, block_ids: list[int]) -> bool:
        return self.pool(lambda p: all(p.blocks[b].ref_count > 0 and p.blocks[b].hash is None for b in block_ids))

    def grab_every_free_block(self) -> list[int]:
        """What a new allocation could get now (and give back at once)."""

        def grab(p):
            blocks = p.allocate(p.num_free)
            p.free(blocks)
            return [b.block_id for b in blocks]

        return self.pool(grab)

    def metric(self, name: str, **labels) -> float:
        """One sample of the decode worker's /metrics for its transfers."""
        metrics = WorkerMetrics(self.engine)
        metrics.registry.register(TransferCollector(self.service, "m"))
        (value,) = samples(metrics.render()[0].decode(), name, **labels)
        return value

    def whole(self) -> bool:
        """Every block back in the pool and none published (nothing was ever proven written)."""
        return self.pool(lambda p: p.num_free == p.num_blocks and not p.resident_hashes())

    def close(self) -> None:
        self.engine.stop()


def test_a_reservation_expiring_during_a_slow_write_is_not_reused_until_the_write_settles(monkeypatch):
    """The WRITE outlives the reservation: the decode side quarantines the granted blocks, so
    neither a new allocation gets them nor the cache serves them while the bytes land; the
    writer's late commit ends the quarantine (its answer sends the writer to HTTP)."""
    monkeypatch.setattr(transfer_nixl, "RESERVE_BASE_S", TTL_S)
    seen = {}

    def slow_write(remote: list[int]) -> int:
        wait_for(lambda: pair.decode.expired == 1, timeout=10.0, interval=0.01, what="the reservation to expire")
        seen["reusable"] = set(pair.grab_every_free_block()) & set(remote)
        seen["held"] = pair.held_unpublished(remote)  # as the late bytes land
        return len(remote) * 16

    pair = Pair(slow_write)
    try:
        ok = asyncio.run(pair.prefill.send(pair.client, "http://d", pair.header, [0, 1, 2], {}))
        assert not ok and pair.prefill.fallbacks == 1, "a late commit is refused: the sender falls back"
        assert seen == {"reusable": set(), "held": True}
        stats = pair.decode.stats()
        assert (stats["expired"], stats["quarantined"], stats["committed"]) == (1, 0, 0)
        assert stats["quarantine_releases"] == {"completed": 1, "timed_out": 0}
        assert pair.whole()
    finally:
        pair.close()


def test_an_unsettled_failure_is_quarantined_until_its_time_runs_out(monkeypatch):
    """A writer that timed out with its WRITE possibly still in flight says so: the decode side
    keeps the granted blocks for another lifetime before they can be reused."""
    monkeypatch.setattr(transfer_nixl, "RESERVE_BASE_S", TTL_S)

    def lost_write(remote: list[int]) -> int:
        seen.extend(remote)
        raise NixlError("timed out", settled=False)

    seen: list[int] = []
    pair = Pair(lost_write)

    async def run() -> None:
        assert not await pair.prefill.send(pair.client, "http://d", pair.header, [0, 1, 2], {})
        assert pair.decode.stats()["quarantined_blocks"] == 3 and pair.held_unpublished(seen)
        assert not set(pair.grab_every_free_block()) & set(seen)
        while pair.decode.quarantined and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    deadline = time.monotonic() + 30

    try:
        asyncio.run(run())
        assert pair.decode.stats()["quarantine_releases"] == {"completed": 0, "timed_out": 1}
        assert pair.whole() and pair.decode.expired == 0
    finally:
        pair.close()


def test_a_settled_failure_frees_at_once_and_a_silent_writer_after_two_lifetimes(monkeypatch):
    """`settled`: nothing can land, so the blocks go back now. A writer that never commits (it
    died) leaves the reservation to expire and then to run out its quarantine."""
    monkeypatch.setattr(transfer_nixl, "RESERVE_BASE_S", TTL_S)

    def failed_write(remote: list[int]) -> int:
        raise NixlError("ended ERR")

    pair = Pair(failed_write)
    try:
        assert not asyncio.run(pair.prefill.send(pair.client, "http://d", pair.header, [0, 1, 2], {}))
        assert pair.decode.stats()["quarantined"] == 0 and pair.whole()

        async def reserve_and_vanish() -> list[int]:
            r = await pair.client.post("/kv/nixl/reserve", content=pair.header, headers=HEADERS)
            await asyncio.sleep(1.5 * TTL_S)  # past the lifetime, inside the quarantine
            blocks = r.json()["blocks"]
            assert pair.decode.expired == 1 and pair.held_unpublished(blocks)
            while pair.decode.quarantined and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return blocks

        deadline = time.monotonic() + 30
        asyncio.run(reserve_and_vanish())
        assert pair.decode.stats()["quarantine_releases"]["timed_out"] == 1 and pair.whole()
    finally:
        pair.close()


def test_a_writer_hung_mid_write_holds_its_blocks_no_longer_than_the_quarantine_bound(monkeypatch):
    """The WRITE never completes and its writer never commits (it died, or hangs): the
    reservation expires, its blocks are quarantined for the configured bound (not another
    lifetime), then return to the pool as `timed_out`; the writer's commit, when it finally
    comes, is refused, so it falls back and nothing it wrote is published."""
    monkeypatch.setattr(transfer_nixl, "RESERVE_BASE_S", 0.2)
    bound = 0.3
    unblock = threading.Event()
    granted: list[int] = []

    def hung_write(remote: list[int]) -> int:
        granted.extend(remote)
        unblock.wait(30)
        raise NixlError("timed out", settled=False)

    pair = Pair(hung_write, quarantine_s=bound)

    async def run() -> bool:
        sender = asyncio.create_task(pair.prefill.send(pair.client, "http://d", pair.header, [0, 1, 2], {}))
        await wait_until(lambda: pair.decode.quarantined)
        (q,) = pair.decode.quarantined.values()
        assert q.timer.when() - asyncio.get_running_loop().time() <= bound, "the bound, not another lifetime"
        assert pair.held_unpublished(granted) and not set(pair.grab_every_free_block()) & set(granted)
        assert pair.metric("kvgate_worker_kv_quarantined_blocks") == len(granted) == 3
        await wait_until(lambda: not pair.decode.quarantined)
        assert pair.decode.stats()["quarantine_releases"] == {"completed": 0, "timed_out": 1}
        assert pair.metric("kvgate_worker_kv_quarantined_blocks") == 0
        releases = "kvgate_worker_kv_quarantine_releases_total"
        assert (pair.metric(releases, outcome="timed_out"), pair.metric(releases, outcome="completed")) == (1, 0)
        assert pair.whole(), "the blocks are back while the WRITE still hangs"
        unblock.set()
        return await sender

    try:
        assert not asyncio.run(run()) and pair.prefill.fallbacks == 1
        assert pair.decode.stats()["quarantine_releases"]["completed"] == 0 and pair.whole()
    finally:
        unblock.set()
        pair.close()


def test_a_write_that_never_completes_falls_back_to_http_into_other_blocks(monkeypatch):
    """The WRITE never completes (its writer gives up, unsettled): the decode side quarantines
    the granted blocks, the export goes by HTTP instead and lands in other blocks, which are
    published; after the bound the quarantined ones return. Nothing leaks on either side."""
    monkeypatch.setattr(transfer_nixl, "RESERVE_BASE_S", TTL_S)
    granted: list[int] = []

    def lost_write(remote: list[int]) -> int:
        granted.extend(remote)
        raise NixlError("timed out", settled=False)

    pair = Pair(lost_write, quarantine_s=0.3)
    prefill = sim_engine(num_blocks=16, block_size=4)
    prefill.start()
    sender = TransferService(prefill, "m", TOKEN)
    sender.nixl = NixlTransfer(sender, FakeAgent("p", 16, lost_write))
    sender.client = pair.client
    hashes = block_hashes(PROMPT, 4, pair.engine.kv.seed)

    def published(p) -> dict[int, int]:
        return {b.hash: b.block_id for b in p.blocks if b.hash is not None}

    async def run() -> None:
        held = prefill.call(lambda: prefill.pool.allocate(3)).result(timeout=10)
        tokens = [PROMPT[i : i + 4] for i in (0, 4, 8)]
        assert await sender.send("http://d", hashes, tokens, held), "the blocks arrived by HTTP"
        assert sender.nixl.fallbacks == 1 and pair.decode.stats()["quarantined_blocks"] == 3
        landed = pair.pool(published)
        assert set(landed) == set(hashes) and not set(landed.values()) & set(granted)
        assert pair.held_unpublished(granted)
        deadline = time.monotonic() + 30
        while pair.decode.quarantined and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    try:
        asyncio.run(run())
        assert pair.decode.stats()["quarantine_releases"] == {"completed": 0, "timed_out": 1}
        assert pair.pool(lambda p: p.num_free == p.num_blocks and set(p.resident_hashes()) == set(hashes))
        assert prefill.call(lambda: prefill.pool.num_free).result(timeout=10) == 16
    finally:
        prefill.stop()
        pair.close()


def test_a_commit_must_say_settled_as_a_boolean():
    pair = Pair(lambda remote: 0)
    try:

        async def commit(body: dict) -> int:
            return (await pair.client.post("/kv/nixl/commit", json=body, headers=HEADERS)).status_code

        assert asyncio.run(commit({"id": "x", "ok": False, "settled": "yes"})) == 400
        assert asyncio.run(commit({"id": "x", "ok": False, "settled": True})) == 409
    finally:
        pair.close()


def test_a_malformed_header_is_a_400_at_reserve_and_holds_nothing():
    """A peer's header out of range (a parent past 64 bits, a token past int64) or nested past
    the stack was an exception out of the endpoint: a 500."""
    pair = Pair(lambda remote: 0)
    try:

        async def reserve_all() -> dict[str, tuple[int, str]]:
            answers = {}
            for shape, body in malformed(pair.service.spec).items():
                r = await pair.client.post("/kv/nixl/reserve", content=body, headers=HEADERS)
                answers[shape] = r.status_code, r.json()["error"]["code"]
            return answers

        answers = asyncio.run(reserve_all())
        assert all(answer == (400, "bad_kv_transfer") for answer in answers.values()), answers
        assert pair.whole() and not pair.decode.reservations
    finally:
        pair.close()
